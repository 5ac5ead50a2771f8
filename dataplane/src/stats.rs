//! Counters for every drop, delivery, congestion and app-lifecycle event. Relaxed atomic
//! increments (no locks) so the poll core can bump them; `rdsctl stats` reads them.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! counters {
    ($(#[$sdoc:meta])* $ty:ident { $($(#[doc = $doc:literal])* $name:ident),* $(,)? }) => {
        $(#[$sdoc])*
        #[derive(Default, Debug)]
        pub struct $ty { $($(#[doc = $doc])* pub $name: AtomicU64,)* }

        impl $ty {
            /// `(name, value)` for every counter, in declaration order.
            fn each(&self, prefix: &str, out: &mut Vec<(String, u64)>) {
                $(out.push((format!("{prefix}{}", stringify!($name)), self.$name.load(Ordering::Relaxed)));)*
            }

            /// `(name, doc comment)` for every counter, in declaration order (metrics HELP).
            fn each_help(prefix: &str, out: &mut Vec<(String, &'static str)>) {
                $(out.push((format!("{prefix}{}", stringify!($name)), concat!($($doc),*).trim()));)*
            }
        }
    };
}

counters! {
    /// Counters of the daemon as a whole (sockets, apps, loopback, congestion).
    Base {
    /// Processes that attached.
    apps_attached,
    /// Processes that went away (exit, crash or eviction).
    apps_detached,
    /// Processes evicted for breaking the shared-memory protocol.
    apps_evicted,
    /// Attach attempts refused (version mismatch, too many apps, no memory).
    attach_refused,
    /// Malformed control requests.
    ctrl_bad_requests,
    /// Info documents longer than one datagram sent whole, in a memory file.
    ctrl_info_whole,
    /// Info documents asked for whole but cut to one datagram: no memory file could hold them.
    ctrl_info_cut,
    /// Sockets opened.
    sockets_opened,
    /// Sockets closed (explicitly or with their process).
    sockets_closed,
    /// Messages delivered by the loopback transport.
    loop_delivered,
    /// Payload bytes delivered by the loopback transport.
    loop_bytes,
    /// Messages dropped because no socket was bound at the destination.
    drop_unbound_dest,
    /// Deliveries to a port bound before rdsd restarted and not bound again yet, held (the
    /// path paused) during the rebind grace instead of dropped.
    rx_held_for_rebind,
    /// Messages dropped because the sending socket was not bound.
    drop_unbound_sender,
    /// Messages dropped because no transport reaches the destination.
    drop_no_route,
    /// Messages dropped by RDS_CANCEL_SENT_TO.
    drop_cancelled,
    /// Messages dropped because their socket closed before delivery.
    drop_socket_closed,
    /// Messages a transport took in place from the app's tx ring (zero copy): the ring space
    /// stays the daemon's until the peer acknowledges the message.
    tx_in_place,
    /// Of those, sends to a network peer from another poll thread than the connection's
    /// owner, which the owner's transport took from the sender's tx ring (`SendRef`).
    tx_in_place_crossed,
    /// Sends another poll thread forwarded by reference (`SendRef`) that this thread's
    /// transport sent from the sender's tx ring as they lie (over RDMA: from the region the
    /// other thread registered, without a copy into a send slot).
    tx_in_place_forwarded,
    /// App regions kept mapped after their app went, until the messages sent in place from
    /// them were acknowledged or cancelled.
    regions_drained_late,
    /// Departed apps whose in-place messages were cancelled because too many regions were
    /// draining already.
    drain_cancels,
    /// Times a receive ring was full (the message went to the receiver's backlog, or waited).
    rx_ring_full,
    /// Times a local send waited on its tx ring because its receiver had a backlog past its
    /// share (`backlog.rs`).
    tx_held_for_backlog,
    /// Times a network delivery waited (its path paused) because its receiver had a backlog
    /// past its share.
    rx_held_for_backlog,
    /// Messages whose receiver's rx ring was full: kept in the receiver's backlog in rdsd so
    /// that the sender's other messages, the pair ring between two threads and the network
    /// path go on for the other receivers.
    rx_backlogged,
    /// Times a pair ring waited at a message because this poll thread's backlogs held their
    /// 64 MiB already (the other receivers of that ring wait with it).
    rx_backlog_capped,
    /// Ports marked congested.
    cong_marked,
    /// Ports cleared of congestion.
    cong_cleared,
    /// Monitor notifications posted.
    cong_notifications,
    /// Times the poll core parked.
    poll_parks,
    /// `idle = "watch"`: times an idle poll core did not park because an app thread slept in
    /// a receive (on its sockets or another poll core's); it yielded and looked again 1 ms
    /// later.
    parks_withheld,
    /// Passes of the poll core (summed lazily, like the transports' counters).
    poll_passes,
    /// Heap allocations made by the poll threads (counted by rdsd's allocator, published with
    /// `poll_passes`): setup, attaches, binds and backlogs make some; steady traffic none
    /// (`tests/tests/quiet.rs`).
    poll_allocations,
    /// rdsd's own mutexes locked by the poll threads (the bind directory, connection
    /// placement, receive-state slots, RDMA regions): binds and new connections take them;
    /// steady traffic none.
    poll_locks,
    /// Tx rings a pass looked into because their app published on them (an idle socket costs
    /// a pass one load of its ring's producer position and no visit).
    tx_ring_visits,
    /// Passes that took notes or messages from other poll threads (`drain_fabric`; an idle
    /// pass with several poll threads takes none and checks each other thread with three
    /// loads).
    fabric_drains,
    /// Passes that found work (the rest found nothing): with `poll_passes`, how busy a poll
    /// thread is (`rdsctl threads`).
    poll_busy_passes,
    /// Records this poll thread put into other poll threads' pair rings: messages for their
    /// sockets or connections, group copies, cancels (`rdsctl threads`: crossings out).
    shard_records_out,
    /// Records this poll thread took from other poll threads' pair rings (crossings in).
    shard_records_in,
    /// Futex wake-ups of app threads blocked in a send or a receive (one per change that a
    /// blocked thread waits for: a delivery wakes receivers, a release wakes senders).
    app_wakeups,
    /// Publishes of an rx ring by a unicast delivery: one per message, except for local
    /// deliveries taken off one sender's tx ring in one burst, which publish each receiver's
    /// ring once per burst.
    rx_publishes,
    /// Reads of a receiving app's consumed count (on the line the app writes at every
    /// receive) to check its queue against SO_RCVBUF: only when the count last read says the
    /// queue may be over it, not after every publish.
    rx_consumed_reads,
    /// SeqCst fences made before reading blocked threads' `waiters`: one for all the wake
    /// checks of a pass (and one after each network read that delivered), not one per publish.
    wake_fences,
    /// Parks given up because the membarrier before them failed (apps' doorbell checks rely
    /// on it, `DaemonHeader::park_barrier`): the poll thread stayed awake instead.
    park_barrier_failures,
    /// Parks that ran out their safety timeout (`park_timeout_ms`) with no doorbell, after
    /// which the next pass took messages off a tx ring: an app published without ringing
    /// the doorbell of a parked poll thread (0 unless the doorbell protocol is broken, or an
    /// app writes its ring by hand; rarely, a send that landed as the timeout ran out).
    parks_doorbell_missed,
    /// Times a network path stopped reading because a receiver's rx ring was full (the message
    /// waits in rdsd and TCP's window pushes back on the sender; nothing is dropped).
    rx_paused,
    /// Paused paths that resumed once the receiver drained.
    rx_resumed,
    /// Reads of bytes a dying path had received and acknowledged but rdsd had not read yet
    /// (paused, or past a pass's read budget): kept and delivered, not lost with the socket.
    rx_drained_at_path_down,
    /// Connections refused because max_apps connections were open (EUSERS).
    attach_refused_max_apps,
    /// Connections refused by the uid's max_apps_per_uid (EDQUOT).
    attach_refused_uid_apps,
    /// Hellos refused by the uid's max_regions_per_uid (EDQUOT).
    attach_refused_uid_regions,
    /// Connections closed for not sending Hello within hello_timeout_ms.
    hello_timeouts,
    /// Requests withdrawn from a slow poll core and answered ETIMEDOUT (control_timeout_ms).
    ctrl_timeouts,
    /// Poll-core replies that answered no waiting request (discarded, never sent to an app).
    ctrl_stale_replies,
    /// Clients disconnected because their control socket stayed full (replies unread).
    ctrl_unread_disconnects,
    /// Per-pass loops over app-controlled input (doorbells, readiness sockets) that stopped
    /// at their bound with input left: an app is flooding rdsd.
    drain_capped,
    /// App regions whose memory was returned (unmapped and punched out of the memfd, so an
    /// app that keeps the fd holds no pages).
    regions_freed,
    /// Pings to port 0 of a local address answered by the loopback transport (rds-ping).
    loop_pings,
    /// Messages sent to a multicast group, numbered and delivered (to zero or more members).
    group_sends,
    /// Copies of group messages delivered to members (one per member reached).
    group_deliveries,
    /// Group members skipped because their receive buffer was full and they joined with
    /// DROP_WHEN_FULL (one per member and message).
    group_drops_full,
    /// Group members whose filter rejected a message (one per member and message).
    group_filtered,
    /// Messages sent to a multicast address where no group exists (dropped, as to an unbound
    /// port).
    group_no_group,
    /// Times a group message waited on its sender's ring because a member without
    /// DROP_WHEN_FULL had no room (counted once per wait, not per retry).
    group_blocked,
    /// Group messages of sockets of other poll threads that a full member blocked, parked on
    /// shard 0 (their senders' bytes held until decided) so that the ring between the two
    /// threads goes on for everything else.
    group_parked,
    /// Copies of group messages for members of this poll thread whose rx ring was full, kept
    /// until it has room (the fan-out commits once they are in) so that the ring from the
    /// thread that orders the groups goes on for everything else.
    group_copies_waited,
    /// Shard 0: asks to another poll thread to keep room in a group member's rx ring for the
    /// copies to come (credit: a fan-out is decided only with room for every copy).
    group_credit_asks,
    /// Asks of shard 0 answered: room kept in a member's rx ring for its group copies.
    group_credit_grants,
    /// Multicast groups created.
    groups_created,
    /// Memberships that ended by a close or an app's death rather than a leave.
    group_members_closed,
    /// Copies of group messages for members of another poll thread lost because rdsd already
    /// kept 64 MiB for that thread (it has not taken its messages for that long).
    group_remote_lost,
    /// Owner: member hosts accepted into a group (a host's `Join`).
    group_host_joins,
    /// Member host: joins the owner refused (no such group there, not open): the local
    /// memberships of that group were dropped.
    group_host_refused,
    /// Member host: messages of local apps forwarded to the owner of their group.
    group_host_sends,
    /// Owner: numbered messages sent to member hosts (one per host per message).
    group_host_data,
    /// Group protocol messages that could not be sent (no route to the host, or past 4096
    /// hosts), or about a group the receiving host does not have (answered with `Leave`).
    group_host_lost,
    /// Group protocol messages refused: malformed, or not from the group port.
    group_wire_bad,
}
}

counters! {
    /// Counters of one network transport under the shared protocol layer (`protocol::Endpoint`).
    NetStats {
    /// Messages from the network delivered to local sockets.
    delivered,
    /// Outgoing connects started (paths and reconnects).
    connects,
    /// Paths that came up on our connect.
    path_up,
    /// Paths that went down (reset, EOF, error, protocol violation).
    path_down,
    /// Connections accepted as paths.
    accepts,
    /// Connections reset on accept (we connect instead, no free path, local peer).
    accepts_refused,
    /// Peers seen restarting (new generation number).
    peer_restarts,
    /// Messages written (data, control, retransmits).
    tx_messages,
    /// Messages resent after a reconnect (RETRANSMITTED).
    retransmits,
    /// Complete messages read.
    rx_messages,
    /// Malformed headers or extension headers from peers.
    drop_bad_header,
    /// Frames with h_len above 1 MiB (the path was dropped).
    drop_oversize,
    /// Duplicates dropped by sequence number (including after our own restart).
    drop_dup_seq,
    /// Messages nobody handles, or truncated at a path drop.
    drop_unknown,
    /// Paths dropped for protocol errors.
    path_errors,
    /// Paths closed because the peer took the connection for another path (SPORT_IDX said so,
    /// or a restarted peer sent its probe on it; `rds-proto`'s deviations).
    path_mismaps,
    /// Reconnects scheduled.
    reconnects,
    /// Congestion maps sent (one per change per connection, plus one per path-up).
    cong_maps_sent,
    /// Congestion maps received.
    cong_maps_received,
    /// Pings answered.
    pings_received,
    /// Doorbell connects sent (passive side asking the peer to connect).
    doorbells,
    /// Fresh path-0 connections whose data stopped waiting for the probe's pong at the
    /// deadline (a peer that does not answer pings).
    path0_gate_timeouts,
    /// Liveness checks: the peer connected while all our paths to it were up, so each got a
    /// ping (`rds-proto`'s `Connection::handle_accepted`).
    liveness_checks,
    /// Up paths closed because their liveness ping got no pong in time (a dead peer).
    stale_paths_closed,
    /// Connections whose receive sequence numbers were restored from the state file.
    rx_state_restored,
    /// Passes of the poll core over this transport's connections.
    passes,
    /// Paths a pass visited (one with input, a receiver to resume, frames to send or
    /// acknowledgements to ask for); an idle path is skipped.
    path_visits,
    /// Readiness asks of a path (`Link::path_ready`): a path found not ready is asked again
    /// only once the link's readiness epoch moved (userspace TCP), every pass elsewhere.
    path_checks,
    /// Reads of a path (a `recv` for kernel TCP); only paths the link reports ready are read.
    path_reads,
    /// Of those, reads of the rest of a long payload straight into its reassembly buffer
    /// (kernel TCP: no copy through the endpoint's 64 KiB buffer).
    path_direct_reads,
    /// Queries of a path's acknowledged offset (a `SIOCOUTQ` ioctl for kernel TCP).
    ack_queries,
    /// Reads that took a message flagged `RDS_FLAG_ACK_REQUIRED` (its sender's send buffer
    /// half used), after which the link acknowledged at once (userspace TCP with a delayed
    /// ACK; kernel TCP leaves its ACKs to the kernel).
    acks_forced,
    /// Cancelled messages that had been written when cancelled (RDMA: a posted SEND reads the
    /// payload until it completes), released only once the device had read them.
    cancels_held_for_device,
}
}

counters! {
    /// Counters of the DPDK port (`transport::dpdk`): the port's, and TCP's as the device sees
    /// it on the wire (smoltcp keeps its own private).
    DpdkPort {
    /// Frames received.
    rx_packets,
    /// Non-empty receive bursts.
    rx_bursts,
    /// Frames sent.
    tx_packets,
    /// Transmit bursts.
    tx_bursts,
    /// Frames that found the mempool empty (dropped; TCP resends).
    mbuf_alloc_failures,
    /// Frames not sent (driver refused them, or no mbuf).
    tx_drops,
    /// Received frames dropped unread (multi-segment).
    rx_drops,
    /// TCP data segments sent again.
    tcp_retransmits,
    /// Of those, after three duplicate ACKs.
    tcp_fast_retransmits,
    /// Of those, after a retransmission timeout.
    tcp_rto_retransmits,
    /// TCP data segments received after a gap.
    tcp_rx_out_of_order,
    /// TCP data segments received twice.
    tcp_rx_duplicates,
    /// Peer segments advertising a zero window (our sending stalls).
    tcp_zero_window_rx,
    /// Our segments advertising a zero window.
    tcp_zero_window_tx,
    /// Passes in which smoltcp's egress ran (something may have gone out: a socket got input
    /// or changed, or a timer came due).
    egress_runs,
    /// Sockets those egress runs dispatched: only those that may have something to send, not
    /// every path and listener (vendored smoltcp, PATCHES.md item 4).
    egress_sockets,
    /// Sockets those egress runs examined, dispatched or skipped as not due: only the due
    /// sockets, unless a timer may have come (PATCHES.md item 4).
    egress_examined,
    /// TCP sockets smoltcp's ingress asked to take a segment: one per segment once its port
    /// pair is known, not every listener first (PATCHES.md item 6).
    ingress_examined,
    /// Frames received on this poll thread's queue that belong to another's connection, handed
    /// over (`[dpdk] queues` > 1: software steering).
    steered,
    /// Of those, dropped because the owner's inbox was full (TCP resends).
    steer_drops,
}
}

/// All of rdsd's counters: the daemon's, then one group per network transport, whose names
/// carry the transport's prefix (`tcp_delivered`, ...).
#[derive(Default, Debug)]
pub struct Stats {
    /// Daemon-wide counters.
    pub base: Base,
    /// The kernel-TCP transport.
    pub tcp: NetStats,
    /// The DPDK transport's protocol layer.
    pub dpdk: NetStats,
    /// The DPDK port.
    pub dpdk_port: DpdkPort,
    /// The RDMA transport (verbs, RC queue pairs).
    pub rdma: NetStats,
    /// The counters of the other poll threads (each bumps its own, so no cache line is
    /// shared on the fast path), added into this one's `snapshot`.
    others: std::sync::OnceLock<Vec<std::sync::Arc<Stats>>>,
}

impl std::ops::Deref for Stats {
    type Target = Base;
    fn deref(&self) -> &Base {
        &self.base
    }
}

impl Stats {
    /// `(name, value)` for every counter, in a stable order: the sums over the poll threads.
    pub fn snapshot(&self) -> Vec<(String, u64)> {
        let mut out = self.own_snapshot();
        for o in self.others.get().into_iter().flatten() {
            for (sum, (_, v)) in out.iter_mut().zip(o.own_snapshot()) {
                sum.1 += v;
            }
        }
        out
    }

    /// This poll thread's own counters (shard 0's include the control thread's), in the
    /// order of [`Stats::snapshot`].
    fn own_snapshot(&self) -> Vec<(String, u64)> {
        let mut out = Vec::with_capacity(160);
        self.base.each("", &mut out);
        self.tcp.each("tcp_", &mut out);
        self.dpdk.each("dpdk_", &mut out);
        self.dpdk_port.each("dpdk_", &mut out);
        self.rdma.each("rdma_", &mut out);
        out
    }

    /// Each poll thread's own counters, thread 0 (this one) first: what
    /// [`Stats::snapshot`] sums (`rdsctl threads`).
    pub fn per_thread(&self) -> Vec<Vec<(String, u64)>> {
        std::iter::once(self)
            .chain(self.others.get().into_iter().flatten().map(|o| &**o))
            .map(Stats::own_snapshot)
            .collect()
    }

    /// Counts `others` (the other poll threads' counters) in this one's snapshot. Once.
    pub fn count_others(&self, others: Vec<std::sync::Arc<Stats>>) {
        let _ = self.others.set(others);
    }

    /// `(name, value, description)` for every counter, in the order of [`Stats::snapshot`]
    /// (the description is the counter's doc comment; `rdsctl stats --prometheus`, metrics).
    pub fn described(&self) -> Vec<(String, u64, &'static str)> {
        let mut help = Vec::with_capacity(64);
        Base::each_help("", &mut help);
        NetStats::each_help("tcp_", &mut help);
        NetStats::each_help("dpdk_", &mut help);
        DpdkPort::each_help("dpdk_", &mut help);
        NetStats::each_help("rdma_", &mut help);
        self.snapshot()
            .into_iter()
            .zip(help)
            .map(|((k, v), (hk, h))| {
                // Both lists come from the same groups in the same order (tested below).
                let h = if hk == k { h } else { "" };
                (k, v, h)
            })
            .collect()
    }

    /// Adds 1 to `c`.
    #[inline]
    pub fn bump(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// Adds 1 to `c`, which only the calling thread writes: a poll thread's own counters on
    /// the message path (each poll thread has its own `Stats`; shard 0's is shared with the
    /// control thread, which writes other counters). A plain load and store: `bump`'s locked
    /// add is a full barrier on x86, which made the poll thread wait, after every message,
    /// until its stores (the rings' positions the apps poll) had reached the other cores.
    #[inline]
    pub fn bump_mine(c: &AtomicU64) {
        Self::add_mine(c, 1);
    }

    /// Adds `n` to `c`, which only the calling thread writes (see [`Self::bump_mine`]).
    #[inline]
    pub fn add_mine(c: &AtomicU64, n: u64) {
        c.store(c.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
    }

    /// `name value` lines.
    pub fn render(&self) -> String {
        let mut s = String::new();
        for (k, v) in self.snapshot() {
            let _ = writeln!(s, "{k} {v}");
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_lists_every_counter() {
        let s = Stats::default();
        Stats::bump(&s.drop_cancelled);
        let text = s.render();
        assert!(text.contains("drop_cancelled 1\n"));
        Stats::bump(&s.tcp.doorbells);
        assert!(text.contains("drop_cancelled 1\n"));
        assert!(s.render().contains("tcp_doorbells 1\n"));
        assert!(text.lines().count() >= 39);
    }

    #[test]
    fn per_thread_counters_sum_to_the_snapshot() {
        let s = Stats::default();
        let others: Vec<_> = (0..2)
            .map(|_| std::sync::Arc::new(Stats::default()))
            .collect();
        s.count_others(others.clone());
        Stats::bump(&s.loop_delivered);
        Stats::add_mine(&others[1].loop_delivered, 5);
        Stats::bump(&others[0].tcp.tx_messages);
        let per = s.per_thread();
        let get = |v: &[(String, u64)], k: &str| v.iter().find(|(n, _)| n == k).unwrap().1;
        assert_eq!(per.len(), 3);
        let names: Vec<_> = s.snapshot().into_iter().map(|(n, _)| n).collect();
        assert!(per
            .iter()
            .all(|t| t.iter().map(|(n, _)| n).eq(names.iter())));
        assert_eq!([0, 1, 2].map(|k| get(&per[k], "loop_delivered")), [1, 0, 5]);
        assert_eq!(get(&per[1], "tcp_tx_messages"), 1);
        assert_eq!(get(&s.snapshot(), "loop_delivered"), 6);
    }

    #[test]
    fn every_counter_has_a_description() {
        let s = Stats::default();
        Stats::bump(&s.tcp.doorbells);
        let d = s.described();
        assert_eq!(d.len(), s.snapshot().len());
        assert!(d.iter().all(|(_, _, h)| !h.is_empty() && !h.contains('\n')));
        let (_, v, h) = d.iter().find(|(k, _, _)| k == "tcp_doorbells").unwrap();
        assert_eq!(
            (*v, *h),
            (
                1,
                "Doorbell connects sent (passive side asking the peer to connect)."
            )
        );
        let (_, _, h) = d.iter().find(|(k, _, _)| k == "rx_paused").unwrap();
        assert!(
            h.starts_with("Times a network path stopped reading") && h.contains("window pushes"),
            "{h}"
        );
    }
}

//! Introspection snapshots (`rdsctl info`): the sockets of the table and the connections and
//! paths of every transport, copied out by the poll core for the control thread.
//!
//! The control thread asks with [`super::Cmd::Snapshot`] through the ordinary command queue, so
//! the poll core builds a snapshot only between two passes, when such a command is waiting:
//! the steady-state path gains nothing (no lock, no allocation, no syscall, not even a flag
//! test beyond the queue pop it already does). The snapshot is owned data handed back in
//! [`super::CmdReply::Snapshot`]; the control thread adds what it knows (pids, uids) and
//! serialises it off the poll core.

use super::PollCore;
use crate::seam::ConnSnapshot;
use shm_api::ring::RingMemory;
use std::net::Ipv4Addr;
use std::sync::atomic::Ordering;

/// One open socket.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct SockSnapshot {
    /// App index (the control connection's slot).
    pub app: usize,
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
    /// RDS_CONG_MONITOR is on.
    pub cong_monitor: bool,
    /// The app asked for a pollable readiness fd.
    pub pollable: bool,
}

/// What the poll core copies out for `rdsctl info`.
#[derive(Clone, Debug, Default)]
pub struct PollSnapshot {
    /// Open sockets, by app and slot.
    pub sockets: Vec<SockSnapshot>,
    /// Connections of every network transport.
    pub connections: Vec<ConnSnapshot>,
    /// Transports, in routing order.
    pub transports: Vec<&'static str>,
    /// Poll threads whose sockets are in `sockets` (the control thread asks each in turn).
    pub shards_seen: usize,
}

impl PollCore {
    /// Copies out sockets, connections and paths (slow path: on a Snapshot command only).
    pub(super) fn snapshot(&mut self) -> PollSnapshot {
        let mut out = PollSnapshot {
            shards_seen: self.table.shard() + 1,
            ..PollSnapshot::default()
        };
        self.table.for_each_sock(|r, s, ctl| {
            // App-written numbers: only ever shown, never trusted.
            let consumed = ctl.rx_consumed_bytes.load(Ordering::Acquire);
            let sent = ctl.tx_sent_bytes.load(Ordering::Acquire);
            let rx = s.rx.memory();
            out.sockets.push(SockSnapshot {
                app: r.app,
                slot: r.slot,
                pid: 0,
                uid: 0,
                addr: s.bound.map(|b| Ipv4Addr::from(b.0)),
                port: s.bound.map_or(0, |b| b.1),
                rcvbuf: s.rcvbuf,
                sndbuf: s.sndbuf,
                rx_queued_bytes: s.rx_produced.saturating_sub(consumed),
                rx_pending: rx.producer().load(Ordering::Relaxed)
                    != rx.consumer().load(Ordering::Acquire),
                tx_queued_bytes: sent.saturating_sub(s.released),
                congested: s.congested,
                cong_monitor: s.monitor,
                pollable: s.readiness_on,
            });
        });
        for t in self.transports.iter_mut() {
            out.transports.push(t.name());
            t.snapshot(&mut out.connections);
        }
        out
    }
}

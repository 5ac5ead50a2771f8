//! Counters for every drop, delivery, congestion and app-lifecycle event. Relaxed atomic
//! increments (no locks) so the poll core can bump them; `rdsctl stats` reads them.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! counters {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {
        /// All of rdsd's counters.
        #[derive(Default, Debug)]
        pub struct Stats { $($(#[$doc])* pub $name: AtomicU64,)* }

        impl Stats {
            /// `(name, value)` for every counter, in declaration order.
            pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($name), self.$name.load(Ordering::Relaxed)),)*]
            }
        }
    };
}

counters! {
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
    /// Messages dropped because the sending socket was not bound.
    drop_unbound_sender,
    /// Messages dropped because no transport reaches the destination.
    drop_no_route,
    /// Messages dropped by RDS_CANCEL_SENT_TO.
    drop_cancelled,
    /// Messages dropped because their socket closed before delivery.
    drop_socket_closed,
    /// Times a receive ring was full and the sender had to wait.
    rx_ring_full,
    /// Ports marked congested.
    cong_marked,
    /// Ports cleared of congestion.
    cong_cleared,
    /// Monitor notifications posted.
    cong_notifications,
    /// Times the poll core parked.
    poll_parks,
    /// Messages from the network dropped because the receiver's rx ring was full.
    drop_rx_ring_full,
    /// Messages from the network delivered to local sockets.
    tcp_delivered,
    /// Outgoing TCP connects started (paths and reconnects).
    tcp_connects,
    /// Paths that came up on our connect.
    tcp_path_up,
    /// Paths that went down (reset, EOF, error, protocol violation).
    tcp_path_down,
    /// TCP connections accepted as paths.
    tcp_accepts,
    /// TCP connections reset on accept (we connect instead, no free path, local peer).
    tcp_accepts_refused,
    /// Peers seen restarting (new generation number).
    tcp_peer_restarts,
    /// Messages written to TCP (data, control, retransmits).
    tcp_tx_messages,
    /// Messages resent after a reconnect (RETRANSMITTED).
    tcp_retransmits,
    /// Complete messages read from TCP.
    tcp_rx_messages,
    /// Malformed headers or extension headers from peers.
    tcp_drop_bad_header,
    /// Frames with h_len above 1 MiB (the path was dropped).
    tcp_drop_oversize,
    /// Duplicates dropped by sequence number.
    tcp_drop_dup_seq,
    /// Messages nobody handles, or truncated at a path drop.
    tcp_drop_unknown,
    /// Paths dropped for protocol errors.
    tcp_path_errors,
    /// Reconnects scheduled.
    tcp_reconnects,
    /// Congestion maps sent.
    tcp_cong_maps_sent,
    /// Congestion maps received.
    tcp_cong_maps_received,
    /// Pings answered.
    tcp_pings_received,
}

impl Stats {
    /// Adds 1 to `c`.
    #[inline]
    pub fn bump(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
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
        assert!(text.lines().count() >= 39);
    }
}

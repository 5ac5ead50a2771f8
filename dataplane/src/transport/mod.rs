//! Transports: how a message leaves the poll core.
//!
//! * `loopback`: the destination is a local address of this rdsd; the payload is copied straight
//!   from the sender's tx ring into the receiver's rx ring (one copy).
//!
//! * `tcp`: RDS/TCP over kernel sockets, an I/O adapter under the sans-IO engine `rds-proto`.
//!
//! DPDK userspace TCP and RDMA will be further adapters under the same engine.

pub mod loopback;
pub mod tcp;

use crate::poll::PollCore;
use crate::stats::Stats;
use std::net::Ipv4Addr;
use std::time::Duration;

/// One message handed to a network transport.
#[derive(Clone, Copy, Debug)]
pub struct OutMsg<'a> {
    /// Sender's bound address (the transport connects from it: RDS addresses are implied by
    /// the TCP endpoints).
    pub laddr: u32,
    /// Destination address.
    pub faddr: u32,
    /// Sender's bound port.
    pub sport: u16,
    /// Destination port.
    pub dport: u16,
    /// Payload, valid for this call only (it lives in the app's tx ring): copy it.
    pub payload: &'a [u8],
    /// Comes back through `PollCore::release_token` when the message is acknowledged by the
    /// peer's transport or cancelled.
    pub token: u64,
}

/// A network transport under the general layer, driven by the poll core.
///
/// The contract: `send` takes a copy of the message and returns at once; `poll` does all I/O
/// (non-blocking, no allocation in steady state) and reports back through the poll core:
/// `deliver_remote` for arriving messages, `release_token` when a message is confirmed,
/// `mirror_peer_map` / `remote_uncongested` for peer congestion maps. Kernel TCP implements it
/// today over the sans-IO engine `rds_proto::Connection`; DPDK userspace TCP and RDMA are
/// further implementations of the same trait.
pub trait NetTransport: Send {
    /// Short name for logs.
    fn name(&self) -> &'static str;
    /// True if this transport is configured to reach `dest`.
    fn routes_to(&self, dest: Ipv4Addr) -> bool;
    /// Queues one message; false if no connection can be made (the caller drops and counts).
    fn send(&mut self, core: &mut PollCore, msg: OutMsg<'_>) -> bool;
    /// One pass of I/O over every connection; returns the work done (0 = idle).
    fn poll(&mut self, core: &mut PollCore) -> usize;
    /// RDS_CANCEL_SENT_TO: drop what `laddr:sport` queued for `dest` (`None` = everything).
    fn cancel(&mut self, laddr: u32, sport: u16, dest: Option<(u32, u16)>);
    /// Our congestion map for `laddr` changed: send it to the peers.
    fn local_congestion_changed(&mut self, laddr: u32);
    /// Descriptors whose readiness must wake a parked poll core.
    fn park_fds(&self, out: &mut Vec<libc::pollfd>);
    /// Longest the poll core may park before `poll` must run again.
    fn next_timeout(&self) -> Option<Duration>;
    /// Copies the transport's counters into the daemon's.
    fn publish_counters(&self, stats: &Stats);
}

//! Transports, and the registry that builds them from the configuration.
//!
//! * `loopback`: the destination is a local address of this rdsd; the payload is copied straight
//!   from the sender's tx ring into the receiver's rx ring (one copy).
//! * `tcp`: RDS/TCP over kernel sockets, a `protocol::Link` under the shared protocol layer.
//! * `utcp`: userspace TCP (smoltcp) as a `protocol::Link`, over any smoltcp device.
//! * `dpdk`: `utcp` over a DPDK port (kernel bypass), when the config has a `[dpdk]` section.
//! * `rdma`: RDS over RDMA RC queue pairs (verbs, rdma_cm), when the config has an `[rdma]` section.
//!
//! A transport is a folder here plus one registration line in [`build`]; it talks to the poll
//! core only through `crate::seam`.

pub mod dpdk;
pub mod handoff;
pub mod loopback;
pub mod rdma;
pub mod tcp;
pub mod utcp;

use crate::config::Config;
use crate::seam::Transport;
use crate::stats::Stats;
use std::sync::Arc;

/// The transports of this configuration, in routing order (the first that routes a
/// destination carries it).
pub fn build(cfg: &Config, stats: &Arc<Stats>) -> std::io::Result<Vec<Box<dyn Transport>>> {
    let mut list: Vec<Box<dyn Transport>> = vec![Box::new(loopback::Loopback::new(cfg, stats))];
    // Before kernel TCP: the DPDK port's routes win.
    if let Some(t) = dpdk::build(cfg, stats).map_err(|e| std::io::Error::other(format!("{e:#}")))? {
        list.push(Box::new(t));
    }
    // Before kernel TCP: with an [rdma] section, its routes go over RDMA.
    if let Some(t) = rdma::build(cfg, stats)? {
        list.push(Box::new(t));
    }
    if let Some(t) = tcp::build(cfg, stats)? {
        list.push(Box::new(t));
    }
    Ok(list)
}

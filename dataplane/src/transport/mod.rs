//! Transports, and the registry that builds them from the configuration.
//!
//! * `loopback`: the destination is a local address of this rdsd; the payload is copied straight
//!   from the sender's tx ring into the receiver's rx ring (one copy).
//! * `tcp`: RDS/TCP over kernel sockets, a `protocol::Link` under the shared protocol layer.
//!
//! A transport is a folder here plus one registration line in [`build`]; it talks to the poll
//! core only through `crate::seam`.

pub mod loopback;
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
    if let Some(t) = tcp::build(cfg, stats)? {
        list.push(Box::new(t));
    }
    Ok(list)
}

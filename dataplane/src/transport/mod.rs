//! Transports: how a message leaves the poll core.
//!
//! * `loopback`: the destination is a local address of this rdsd; the payload is copied straight
//!   from the sender's tx ring into the receiver's rx ring (one copy).
//!
//! Network transports (kernel TCP, DPDK userspace TCP, RDMA) sit under the sans-IO general layer
//! in `rds-proto`; see ARCHITECTURE.md.

pub mod loopback;

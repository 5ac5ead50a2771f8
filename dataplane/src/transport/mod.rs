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

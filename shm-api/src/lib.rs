//! # shm-api: RDS sockets served by rdsd over shared memory
//!
//! An application attaches once ([`Rdsd::attach`]), then opens [`Socket`]s that behave like
//! `socket(AF_RDS, SOCK_SEQPACKET, 0)` in rds(7): reliable, ordered datagrams to any
//! `addr:port`. Sends and receives go through lock-free rings in a shared region that rdsd
//! created for this process alone; the data path makes no syscall. Errors are `std::io::Error`s
//! carrying the errno Linux RDS would give.
//!
//! ```no_run
//! use shm_api::Rdsd;
//! use std::net::SocketAddrV4;
//!
//! let rdsd = Rdsd::attach()?;
//! let a = rdsd.socket()?;
//! let b = rdsd.socket()?;
//! a.bind("127.0.0.1:4000".parse::<SocketAddrV4>().unwrap())?;
//! b.bind("127.0.0.1:4001".parse::<SocketAddrV4>().unwrap())?;
//! a.send_to(b"ping", b.local_addr().unwrap())?;
//! let mut buf = [0u8; 64];
//! let (n, from) = b.recv_from(&mut buf)?;
//! assert_eq!((&buf[..n], from), (&b"ping"[..], a.local_addr().unwrap()));
//! # Ok::<(), std::io::Error>(())
//! ```
//!
//! The modules below `socket` are the contract between this library and rdsd (layout, ring,
//! control protocol); rdsd links them too.

#[cfg(not(loom))]
pub mod bias_lock;
pub mod ctrl;
pub mod gate;
pub mod hoptrace;
#[cfg(not(loom))]
pub mod layout;
pub mod ring;
#[cfg(not(loom))]
mod socket;
pub(crate) mod sync;
#[cfg(not(loom))]
pub mod sys;

#[cfg(not(loom))]
pub use socket::{
    daemon_gone, explain, info_at, info_body, is_daemon_gone, is_group, recv_wakeups,
    set_before_block, stats_at, GroupFilter, GroupFlags, Rdsd, RecvFlags, RecvMsg, RecvWakeups,
    Socket, DEFAULT_CONTROL_SOCKET,
};

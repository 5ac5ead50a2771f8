//! Wire formats of RDS over TCP (spec §1–§5, §6.3, §8). Pure functions and types: no state
//! beyond the stream [`Deframer`], no I/O.
//!
//! The layout follows smoltcp's split: [`HeaderPacket`] wraps a byte buffer and offers checked
//! field accessors, [`HeaderRepr`] is the parsed, owned form with `parse`/`emit`.

mod checksum;
mod cong;
mod deframe;
mod ext;
mod header;

pub use checksum::{compute_header_checksum, verify_header_checksum};
pub use cong::{uncongested_mask, CongMap, CONG_MAP_BYTES};
pub use deframe::{DeframeError, Deframer, Frame, FrameRef};
pub use ext::{ext_type, ExtHeader, ExtHeaders, ExtIter, EXT_SPACE, EXT_TYPE_MAX};
pub use header::{flags, HeaderPacket, HeaderRepr, HEADER_LEN};

use core::fmt;

/// Largest payload of one RDS message (`RDS_MAX_MSG_SIZE`, 1 MiB).
pub const MAX_MSG_SIZE: u32 = 1 << 20;

/// TCP port of the RDS/TCP listener (`RDS_TCP_PORT`).
pub const RDS_TCP_PORT: u16 = 16385;

/// Largest number of paths (TCP connections) per peer pair (`RDS_MPATH_WORKERS`).
pub const MAX_PATHS: usize = 8;

/// The reserved RDS port used by the multipath handshake probe (`RDS_FLAG_PROBE_PORT`).
pub const PROBE_PORT: u16 = 1;

/// The source port of rdsd's liveness pings (plain pings, answered by any RDS peer with a pong
/// on the same path; see `Connection::handle_accepted`). Not reserved: a zero-byte pong to it
/// is taken by the engine only while a liveness ping on that path waits for its answer.
pub const LIVENESS_PORT: u16 = 2;

/// Errors from parsing or building wire structures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Error {
    /// The buffer is shorter than the structure.
    Truncated,
    /// An extension record does not fit in the 16-byte extension area.
    ExtOverflow,
    /// The writer refuses extension types it has no length for.
    ExtUnknownType(u8),
    /// A congestion map whose length is not [`CONG_MAP_BYTES`].
    BadCongMapLen(usize),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Truncated => write!(f, "buffer too short"),
            Error::ExtOverflow => write!(f, "extension header area full"),
            Error::ExtUnknownType(t) => write!(f, "unknown extension header type {t}"),
            Error::BadCongMapLen(n) => write!(f, "congestion map of {n} bytes (expected 8192)"),
        }
    }
}

impl std::error::Error for Error {}

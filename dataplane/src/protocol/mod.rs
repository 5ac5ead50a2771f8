//! The protocol layer shared by every network transport (DESIGN §1a).
//!
//! * [`Endpoint`]: the connection table over the sans-IO engine `rds_proto::Connection`
//!   (generation, event dispatch, congestion-map mirroring, counters, restart-safe receive
//!   state, pause on a full rx ring). It is a [`crate::seam::Transport`].
//! * [`Link`]: the path I/O a transport provides underneath (stream or message framing).
//! * [`Clock`]: where the endpoint and its link read the time ([`MonotonicClock`] in the
//!   daemon, [`VirtualClock`] in tests).
//! * [`RxStateFile`]: the persisted receive sequence numbers.
//! * [`Payload`]: a queued payload, a pooled copy ([`PoolBuf`]) or the app's bytes in place.
//!
//! A new network transport is a `Link` in its own folder under `transport/` plus one line in
//! `transport::register`.

mod endpoint;
mod link;
mod persist;
mod pool;

pub use crate::clock::{Clock, MonotonicClock, PassTime, VirtualClock};
pub use endpoint::{Endpoint, EndpointConfig, StatsGroup};
pub use link::{Accepted, ConnectPoll, Framing, Link, Read, Write};
pub use persist::RxStateFile;
pub use pool::{InPlaceBytes, Payload, PoolBuf, TCP_ZERO_COPY_MIN};

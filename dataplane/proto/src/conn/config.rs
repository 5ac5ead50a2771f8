//! Connection configuration.

use crate::wire::MAX_PATHS;
use core::fmt;
use std::net::Ipv4Addr;
use std::time::Duration;

/// Parameters of one RDS connection (one local address, one peer address).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Our RDS (and TCP) address.
    pub local_addr: Ipv4Addr,
    /// The peer's RDS (and TCP) address.
    pub peer_addr: Ipv4Addr,
    /// Number of paths we offer in the handshake (1..=8). The connection uses
    /// `min(ours, peer's)`. Use a power of two when `sport_idx` is on (see [`Config::sport_idx`]).
    pub npaths: u8,
    /// Our generation number (`GEN_NUM`): a random non-zero u32 chosen once per daemon start.
    pub generation: u32,
    /// Seed of the engine's RNG (reconnect jitter).
    pub rng_seed: u64,
    /// Put `GEN_NUM` in our probes (recent-kernel behaviour). Default on.
    pub send_gen_num: bool,
    /// Announce `SPORT_IDX`: the I/O layer promises to bind the TCP source port of the
    /// connection for path `p` so that `port % 8 == p`. Default off.
    pub sport_idx: bool,
    /// Initial reconnect backoff bound (`reconnect_min_delay_ms`, 1 ms).
    pub reconnect_min: Duration,
    /// Largest reconnect backoff bound (`reconnect_max_delay_ms`, 1 s). Also caps the
    /// doorbell interval.
    pub reconnect_max: Duration,
    /// Passive side: smallest interval between two [`super::Event::Doorbell`]s (10 ms). After
    /// a doorbell the next one waits at least this bound, which doubles after each doorbell up
    /// to `reconnect_max` and is reset when path 0 comes up.
    pub doorbell_min: Duration,
    /// Passive side: how long a liveness ping may wait for its pong (3 s). When the peer
    /// connects while every path is up, each up path is pinged; a path without a pong by then
    /// is closed as dead (see `Connection::handle_accepted`).
    pub liveness_timeout: Duration,
    /// Which path a message takes (here by the sender's port, as Linux; rdsd's configuration
    /// defaults to the port pair).
    pub path_choice: PathChoice,
    /// The transport's device reads a frame's bytes after it was written (RDMA: a posted
    /// SEND, in place from the app's ring, is read until it completes): a cancelled message
    /// that was written is released only once [`super::Connection::release_cancelled_read`]
    /// says the device is done with it (or the peer acknowledged it, or the path went down),
    /// not at once, so that its bytes are not reused under the device. Default off (TCP copies
    /// what it is given).
    pub hold_cancelled_written: bool,
}

/// Which of a connection's paths a message takes. Either way one socket's messages to one
/// destination (address and port) take one path, so they stay in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PathChoice {
    /// By the sending socket's bound port, as Linux (`rds_send_mprds_hash`): all of a socket's
    /// messages to one host take one path, whatever their destination ports.
    #[default]
    SourcePort,
    /// By the unordered pair of ports: a request `A:x → B:y` and its reply `B:y → A:x` take
    /// the same path, so on TCP each direction's segments carry the other's acknowledgement
    /// (by source port, with several paths a reply mostly goes back on another connection,
    /// and every message draws a pure ACK segment). Order holds per (socket, destination),
    /// not across one socket's destination ports on a host.
    PortPair,
}

impl Config {
    /// A configuration with kernel defaults: 8 paths offered, GEN_NUM sent, no SPORT_IDX,
    /// backoff 1 ms..1 s, doorbell interval 10 ms..1 s.
    pub fn new(local_addr: Ipv4Addr, peer_addr: Ipv4Addr, generation: u32, rng_seed: u64) -> Self {
        Config {
            local_addr,
            peer_addr,
            npaths: MAX_PATHS as u8,
            generation,
            rng_seed,
            send_gen_num: true,
            sport_idx: false,
            reconnect_min: Duration::from_millis(1),
            reconnect_max: Duration::from_secs(1),
            doorbell_min: Duration::from_millis(10),
            liveness_timeout: Duration::from_secs(3),
            path_choice: PathChoice::SourcePort,
            hold_cancelled_written: false,
        }
    }

    /// Checks the invariants [`super::Connection::new`] relies on.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.npaths == 0 || usize::from(self.npaths) > MAX_PATHS {
            return Err(ConfigError::BadPathCount(self.npaths));
        }
        if self.local_addr == self.peer_addr {
            return Err(ConfigError::SameAddress);
        }
        if self.generation == 0 {
            return Err(ConfigError::ZeroGeneration);
        }
        if self.reconnect_min.is_zero() || self.reconnect_min > self.reconnect_max {
            return Err(ConfigError::BadBackoff);
        }
        if self.doorbell_min.is_zero() || self.doorbell_min > self.reconnect_max {
            return Err(ConfigError::BadDoorbell);
        }
        Ok(())
    }
}

/// A rejected [`Config`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigError {
    /// `npaths` outside 1..=8.
    BadPathCount(u8),
    /// Local and peer addresses are equal (that is the loopback transport's job).
    SameAddress,
    /// Generation 0 means "unknown" on the wire and would hide our restarts.
    ZeroGeneration,
    /// `reconnect_min` is zero or above `reconnect_max`.
    BadBackoff,
    /// `doorbell_min` is zero or above `reconnect_max`.
    BadDoorbell,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::BadPathCount(n) => write!(f, "npaths {n} outside 1..=8"),
            ConfigError::SameAddress => write!(f, "local and peer address are the same"),
            ConfigError::ZeroGeneration => write!(f, "generation number must be non-zero"),
            ConfigError::BadBackoff => {
                write!(f, "reconnect_min must be non-zero and <= reconnect_max")
            }
            ConfigError::BadDoorbell => {
                write!(f, "doorbell_min must be non-zero and <= reconnect_max")
            }
        }
    }
}

impl std::error::Error for ConfigError {}

//! Where the protocol layer and its links get the time: a [`Clock`] they are handed, so that
//! the same code runs on the monotonic clock in the daemon and on a virtual clock in tests.
//!
//! The clock is a type parameter of its user (`Endpoint<L, C>`, `UtcpLink<D, C>`), not a trait
//! object: the poll core's pass reads it once, through a call the compiler inlines.

use rds_proto::Instant;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A source of time: nanoseconds since an epoch of the clock's choosing, never going back.
pub trait Clock: Send {
    /// The time now.
    fn now(&self) -> Instant;
}

/// The daemon's clock: `std::time::Instant` (CLOCK_MONOTONIC) since the clock was made.
#[derive(Clone, Copy, Debug)]
pub struct MonotonicClock {
    epoch: std::time::Instant,
}

impl MonotonicClock {
    /// A clock whose epoch is now.
    pub fn new() -> MonotonicClock {
        MonotonicClock {
            epoch: std::time::Instant::now(),
        }
    }
}

impl Default for MonotonicClock {
    fn default() -> MonotonicClock {
        MonotonicClock::new()
    }
}

impl Clock for MonotonicClock {
    #[inline]
    fn now(&self) -> Instant {
        Instant::from_nanos(self.epoch.elapsed().as_nanos() as u64)
    }
}

/// A clock that stands still until it is advanced; clones share one time (two endpoints, their
/// links and the wire between them see the same instant). For tests.
#[derive(Clone, Debug, Default)]
pub struct VirtualClock(Arc<AtomicU64>);

impl VirtualClock {
    /// A clock at its epoch.
    pub fn new() -> VirtualClock {
        VirtualClock::default()
    }

    /// Moves every clone of this clock forward by `d`.
    pub fn advance(&self, d: Duration) {
        let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.0.fetch_add(nanos, Ordering::Relaxed);
    }

    /// Time since the epoch.
    pub fn elapsed(&self) -> Duration {
        Duration::from_nanos(self.0.load(Ordering::Relaxed))
    }
}

impl Clock for VirtualClock {
    #[inline]
    fn now(&self) -> Instant {
        Instant::from_nanos(self.0.load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn virtual_clock_moves_only_when_advanced_and_clones_share_it() {
        let a = VirtualClock::new();
        let b = a.clone();
        assert_eq!(a.now(), Instant::ZERO);
        a.advance(Duration::from_micros(150));
        assert_eq!(b.now(), Instant::from_nanos(150_000));
        assert_eq!(b.elapsed(), Duration::from_micros(150));
    }

    #[test]
    fn monotonic_clock_never_goes_back() {
        let c = MonotonicClock::new();
        let t0 = c.now();
        assert!(c.now() >= t0);
    }
}

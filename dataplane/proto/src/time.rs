//! Virtual time. The engine never reads a clock: every entry point takes `now`.

use core::ops::{Add, AddAssign};
use std::time::Duration;

/// An opaque point in virtual time, in nanoseconds since an arbitrary epoch chosen by the caller.
///
/// The I/O layer maps its real clock onto this (e.g. nanoseconds since start-up); tests drive it
/// by hand.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Instant(u64);

impl Instant {
    /// The epoch.
    pub const ZERO: Instant = Instant(0);

    /// Builds an instant from nanoseconds since the epoch.
    pub const fn from_nanos(nanos: u64) -> Self {
        Instant(nanos)
    }

    /// Nanoseconds since the epoch.
    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// Time elapsed from `earlier` to `self`, or zero if `earlier` is later.
    pub fn saturating_duration_since(self, earlier: Instant) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

impl Add<Duration> for Instant {
    type Output = Instant;

    /// Saturates at the far future instead of overflowing.
    fn add(self, rhs: Duration) -> Instant {
        let nanos = u64::try_from(rhs.as_nanos()).unwrap_or(u64::MAX);
        Instant(self.0.saturating_add(nanos))
    }
}

impl AddAssign<Duration> for Instant {
    fn add_assign(&mut self, rhs: Duration) {
        *self = *self + rhs;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_saturates() {
        let t = Instant::from_nanos(10);
        assert_eq!((t + Duration::from_nanos(5)).as_nanos(), 15);
        assert_eq!((t + Duration::MAX).as_nanos(), u64::MAX);
        assert_eq!(Instant::ZERO.saturating_duration_since(t), Duration::ZERO);
        assert_eq!(
            t.saturating_duration_since(Instant::ZERO),
            Duration::from_nanos(10)
        );
    }
}

//! Where the protocol layer and its links get the time: a [`Clock`] they are handed, so that
//! the same code runs on the monotonic clock in the daemon and on a virtual clock in tests.
//!
//! The clock is a type parameter of its user (`Endpoint<L, C>`, `UtcpLink<D, C>`), not a trait
//! object, through a call the compiler inlines.
//!
//! One reading per pass: the poll core opens a [`PassTime`] at the start of a pass, and every
//! [`MonotonicClock`] on that thread (the endpoints, smoltcp's interface) then answers with
//! the pass's time instead of reading the clock again (each reading is a vDSO call plus
//! `Instant` arithmetic, ~70 instructions: several per pass on a DPDK rdsd). A pass lasts
//! microseconds, so timers still fire within a pass of their deadline, and the time never goes
//! back: a pass's time is a reading taken after the previous pass's.

use rds_proto::Instant;
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// A source of time: nanoseconds since an epoch of the clock's choosing, never going back.
pub trait Clock: Send {
    /// The time now.
    fn now(&self) -> Instant;
}

/// The daemon's clock: CLOCK_MONOTONIC since the first clock of the process was made (one
/// epoch for all, so that one reading per pass serves them all), or the time of the pass in
/// progress on this thread ([`PassTime`]).
#[derive(Clone, Copy, Debug)]
pub struct MonotonicClock {
    /// CLOCK_MONOTONIC at the epoch, in nanoseconds.
    epoch: u64,
}

/// CLOCK_MONOTONIC in nanoseconds: the vDSO call without `std::time::Instant`'s checked
/// `timespec` arithmetic (a third of a reading's instructions).
#[inline]
fn monotonic_nanos() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the call; CLOCK_MONOTONIC always exists
    // on Linux, so the call cannot fail.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64) * 1_000_000_000 + ts.tv_nsec as u64
}

/// No pass in progress on this thread: read the clock.
const NO_PASS: u64 = u64::MAX;
/// A pass in progress that has not read the clock yet: the first reading is its time (a pass
/// that never asks, a local-only one, reads no clock at all).
const PASS_UNREAD: u64 = u64::MAX - 1;

thread_local! {
    /// The time of the pass in progress on this thread, in nanoseconds since the epoch, or
    /// `NO_PASS`, `PASS_UNREAD`.
    static PASS_NOW: Cell<u64> = const { Cell::new(NO_PASS) };
}

impl MonotonicClock {
    /// A clock on the process's epoch.
    pub fn new() -> MonotonicClock {
        static EPOCH: OnceLock<u64> = OnceLock::new();
        MonotonicClock {
            epoch: *EPOCH.get_or_init(monotonic_nanos),
        }
    }

    /// Reads the clock itself, pass or no pass.
    #[inline]
    fn read(&self) -> Instant {
        Instant::from_nanos(monotonic_nanos().saturating_sub(self.epoch))
    }
}

/// The pass in progress on this thread: while it lives, [`MonotonicClock::now`] on this
/// thread returns the time of the pass's first reading. Dropping it ends the pass.
#[must_use = "the pass ends when this is dropped"]
pub struct PassTime {
    outer: u64,
}

impl PassTime {
    /// Opens this thread's pass.
    #[inline]
    pub fn begin() -> PassTime {
        PassTime {
            outer: PASS_NOW.with(|p| p.replace(PASS_UNREAD)),
        }
    }

    /// Ends the pass: its time, if anything in it read the clock.
    #[inline]
    pub fn end(self) -> Option<Instant> {
        let t = PASS_NOW.with(Cell::get);
        drop(self);
        (t < PASS_UNREAD).then(|| Instant::from_nanos(t))
    }
}

impl Drop for PassTime {
    #[inline]
    fn drop(&mut self) {
        PASS_NOW.with(|p| p.set(self.outer));
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
        match PASS_NOW.with(Cell::get) {
            NO_PASS => self.read(),
            PASS_UNREAD => {
                let t = self.read();
                PASS_NOW.with(|p| p.set(t.as_nanos()));
                t
            }
            t => Instant::from_nanos(t),
        }
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
    fn a_pass_reads_the_clock_once_and_time_moves_on_after_it() {
        let c = MonotonicClock::new();
        let before = c.now();
        let pass = PassTime::begin();
        std::thread::sleep(Duration::from_millis(2));
        let at = c.now();
        assert!(
            at >= before + Duration::from_millis(2),
            "the first reading is fresh"
        );
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(c.now(), at, "later readings in the pass return the first");
        assert_eq!(MonotonicClock::new().now(), at, "every clock, one epoch");
        let other = std::thread::spawn(move || MonotonicClock::new().now())
            .join()
            .unwrap();
        assert!(other > at, "another thread reads its own time");
        assert_eq!(pass.end(), Some(at));
        assert!(
            c.now() >= at + Duration::from_millis(2),
            "read again after the pass"
        );
        assert_eq!(
            PassTime::begin().end(),
            None,
            "a pass that never asked read nothing"
        );
    }

    #[test]
    fn monotonic_clock_never_goes_back() {
        let c = MonotonicClock::new();
        let t0 = c.now();
        assert!(c.now() >= t0);
    }
}

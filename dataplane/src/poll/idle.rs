//! What a poll core does when a pass found nothing to do (Aeron-style idle strategies).

use crate::clock::{Clock, MonotonicClock};
use crate::config::IdleMode;
use rds_proto::Instant;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

/// Idle strategy state for one poll core.
///
/// The backoff phases are measured in time, not passes: a pass costs ~50 ns with loopback only
/// and several µs with eight TCP paths to poll, and what matters is how long the core holds the
/// CPU. Spinning with `pause` is short by default because on a shared core it keeps the apps
/// (and another rdsd) off the CPU for a whole scheduler slice; yielding instead gives the CPU to
/// whoever is runnable at once and costs one cheap syscall when nobody is (bench/RESULTS.md,
/// "Where the time goes").
pub struct Idle {
    mode: IdleMode,
    spin: Duration,
    yield_for: Duration,
    park_timeout_ms: i32,
    idle_since: Option<Instant>,
    /// Yield, not park, until then: a park was withheld for a sleeping app thread (`Watch`),
    /// or a park just ended on a file descriptor ([`LINGER_AFTER_WAKE`]). Work clears it.
    awake_until: Option<Instant>,
    doorbell: Arc<OwnedFd>,
}

/// `Watch`: how long a poll thread that found an app thread asleep in a receive yields before
/// it looks again (the look reads every socket's `waiters`).
const WATCH_RECHECK: Duration = Duration::from_millis(1);

/// How long a poll thread woken from a park by a file descriptor (a doorbell, a socket)
/// yields before it parks again, work or not. Without it a wake-up that found no work parked
/// again at once, and an app draining a deep rx ring while rdsd slept rang the doorbell after
/// every message it took (each release of ring space rings a parked rdsd, which may be
/// waiting for that room): 91 to 1737 `sendto`s for 5000 messages in 7 of 22 runs under load,
/// and 1 in 1 of 22 with it (`bench/results/epoll-doorbell-2core-s24/`). Awake for this long,
/// rdsd hears the next releases without a doorbell; the cost is this much yielding per
/// wake-up that brings no work.
const LINGER_AFTER_WAKE: Duration = Duration::from_micros(200);

impl Idle {
    /// `doorbell` is the control thread's eventfd for waking a parked core. It is rdsd's own
    /// (never passed to an app), so its O_NONBLOCK flag is ours; apps have one doorbell each
    /// (`SocketTable::doorbell_fds`).
    pub fn new(
        mode: IdleMode,
        spin: Duration,
        yield_for: Duration,
        park_timeout_ms: u64,
        doorbell: Arc<OwnedFd>,
    ) -> Idle {
        Idle {
            mode,
            spin,
            yield_for,
            park_timeout_ms: park_timeout_ms.min(i32::MAX as u64) as i32,
            idle_since: None,
            awake_until: None,
            doorbell,
        }
    }

    /// Called after every pass, with the pass's time if it read the clock (one reading per
    /// pass). Returns true when the core should park now (with `Watch`, unless
    /// [`Idle::stay_awake`] says otherwise).
    #[inline]
    pub fn idle(&mut self, work: usize, pass_time: Option<Instant>) -> bool {
        if work > 0 {
            self.idle_since = None;
            self.awake_until = None;
            return false;
        }
        match self.mode {
            IdleMode::Spin => {
                std::hint::spin_loop();
                false
            }
            IdleMode::Backoff | IdleMode::Watch => {
                let now = pass_time.unwrap_or_else(|| MonotonicClock::new().now());
                let idle = now.saturating_duration_since(*self.idle_since.get_or_insert(now));
                if idle < self.spin {
                    std::hint::spin_loop();
                    false
                } else if idle < self.spin + self.yield_for
                    || self.awake_until.is_some_and(|t| now < t)
                {
                    std::thread::yield_now();
                    false
                } else {
                    true
                }
            }
        }
    }

    /// True if a park is withheld while an app thread sleeps in a receive (`Watch`).
    pub fn watches(&self) -> bool {
        self.mode == IdleMode::Watch
    }

    /// `Watch`: an app thread sleeps in a receive; yield instead of parking, and look again
    /// in [`WATCH_RECHECK`].
    pub fn stay_awake(&mut self) {
        self.awake_until = Some(MonotonicClock::new().now() + WATCH_RECHECK);
        std::thread::yield_now();
    }

    /// Sleeps until the doorbell rings, one of `extra` (app doorbells, transport sockets) is
    /// ready, `timeout` (a transport timer) or the park timeout passes.
    ///
    /// True if nothing woke it before its safety timeout (`park_timeout_ms`; `timeout` was
    /// `None`): whatever it finds next should have rung a doorbell.
    pub fn park(
        &mut self,
        extra: &mut Vec<libc::pollfd>,
        timeout: Option<std::time::Duration>,
    ) -> bool {
        let fd = self.doorbell.as_raw_fd();
        extra.push(libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        });
        let ms = timeout.map_or(self.park_timeout_ms, |t| {
            (t.as_millis() as i32).clamp(0, self.park_timeout_ms)
        });
        // SAFETY: `extra` is a valid array of pollfd for the call.
        let ready = unsafe { libc::poll(extra.as_mut_ptr(), extra.len() as libc::nfds_t, ms) };
        shm_api::sys::eventfd_drain(fd);
        if ready > 0 {
            self.awake_until = Some(MonotonicClock::new().now() + LINGER_AFTER_WAKE);
        }
        ready == 0 && timeout.is_none()
    }

    /// Starts the backoff over.
    pub fn reset(&mut self) {
        self.idle_since = None;
        self.awake_until = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_spins_then_yields_then_parks() {
        let fd = Arc::new(shm_api::sys::eventfd().unwrap());
        let ms = Duration::from_millis;
        let mut i = Idle::new(IdleMode::Backoff, ms(20), ms(20), 1, fd.clone());
        let t = std::time::Instant::now();
        while !i.idle(0, None) {}
        assert!(
            t.elapsed() >= ms(40),
            "spins then yields for the configured time"
        );
        assert!(!i.idle(1, None), "work resets the backoff");
        assert!(!i.idle(0, None));
        // A rung doorbell ends the park at once.
        shm_api::sys::eventfd_signal(fd.as_raw_fd());
        let t = std::time::Instant::now();
        let mut i = Idle::new(IdleMode::Backoff, Duration::ZERO, Duration::ZERO, 5_000, fd);
        i.park(&mut Vec::new(), None);
        assert!(t.elapsed() < std::time::Duration::from_secs(1));
    }

    #[test]
    fn watch_yields_until_it_looks_again() {
        let fd = Arc::new(shm_api::sys::eventfd().unwrap());
        let mut i = Idle::new(IdleMode::Watch, Duration::ZERO, Duration::ZERO, 1, fd);
        assert!(i.idle(0, None), "past spin and yield: time to look");
        let t = std::time::Instant::now();
        i.stay_awake();
        while !i.idle(0, None) {}
        assert!(t.elapsed() >= WATCH_RECHECK, "yielded until the next look");
        i.stay_awake();
        assert!(!i.idle(1, None), "work resets it");
        assert!(i.idle(0, None), "and the next idle pass looks at once");
    }

    #[test]
    fn a_park_ended_by_a_doorbell_yields_a_while_before_the_next() {
        let fd = Arc::new(shm_api::sys::eventfd().unwrap());
        let mut i = Idle::new(
            IdleMode::Backoff,
            Duration::ZERO,
            Duration::ZERO,
            1,
            fd.clone(),
        );
        assert!(i.idle(0, None), "past spin and yield: park");
        // Timed out (1 ms): nothing woke it, so the next idle pass parks again at once.
        assert!(i.park(&mut Vec::new(), None), "a silent park");
        assert!(i.idle(0, None));
        // Rung: it yields for the linger before it parks again.
        shm_api::sys::eventfd_signal(fd.as_raw_fd());
        let t = std::time::Instant::now();
        assert!(!i.park(&mut Vec::new(), None));
        assert!(!i.idle(0, None), "lingers after a wake-up");
        while !i.idle(0, None) {}
        assert!(t.elapsed() >= LINGER_AFTER_WAKE, "for the linger");
        assert!(i.idle(0, None), "then parks at once again");
    }

    #[test]
    fn spin_never_parks() {
        let fd = Arc::new(shm_api::sys::eventfd().unwrap());
        let mut i = Idle::new(IdleMode::Spin, Duration::ZERO, Duration::ZERO, 1, fd);
        assert!((0..100_000).all(|_| !i.idle(0, None)));
    }
}

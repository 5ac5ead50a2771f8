//! What a poll core does when a pass found nothing to do (Aeron-style idle strategies).

use crate::config::IdleMode;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;

/// Idle strategy state for one poll core.
pub struct Idle {
    mode: IdleMode,
    spins: u32,
    yields: u32,
    park_timeout_ms: i32,
    count: u32,
    doorbell: Arc<OwnedFd>,
}

impl Idle {
    /// `doorbell` is the eventfd apps and the control thread write to wake a parked core.
    pub fn new(
        mode: IdleMode,
        spins: u32,
        yields: u32,
        park_timeout_ms: u64,
        doorbell: Arc<OwnedFd>,
    ) -> Idle {
        Idle {
            mode,
            spins,
            yields,
            park_timeout_ms: park_timeout_ms.min(i32::MAX as u64) as i32,
            count: 0,
            doorbell,
        }
    }

    /// Called after every pass. Returns true when the core should park now.
    #[inline]
    pub fn idle(&mut self, work: usize) -> bool {
        if work > 0 {
            self.count = 0;
            return false;
        }
        match self.mode {
            IdleMode::Spin => {
                std::hint::spin_loop();
                false
            }
            IdleMode::Backoff => {
                self.count = self.count.saturating_add(1);
                if self.count <= self.spins {
                    std::hint::spin_loop();
                    false
                } else if self.count <= self.spins + self.yields {
                    std::thread::yield_now();
                    false
                } else {
                    true
                }
            }
        }
    }

    /// Sleeps until the doorbell rings, one of `extra` (transport sockets) is ready, `timeout`
    /// (a transport timer) or the park timeout passes.
    pub fn park(&mut self, extra: &mut Vec<libc::pollfd>, timeout: Option<std::time::Duration>) {
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
        unsafe { libc::poll(extra.as_mut_ptr(), extra.len() as libc::nfds_t, ms) };
        shm_api::sys::eventfd_drain(fd);
    }

    /// Starts the backoff over.
    pub fn reset(&mut self) {
        self.count = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_spins_then_yields_then_parks() {
        let fd = Arc::new(shm_api::sys::eventfd().unwrap());
        let mut i = Idle::new(IdleMode::Backoff, 3, 2, 1, fd.clone());
        let parks: Vec<bool> = (0..6).map(|_| i.idle(0)).collect();
        assert_eq!(parks, [false, false, false, false, false, true]);
        assert!(!i.idle(1), "work resets the backoff");
        assert!(!i.idle(0));
        // A rung doorbell ends the park at once.
        shm_api::sys::eventfd_signal(fd.as_raw_fd());
        let t = std::time::Instant::now();
        let mut i = Idle::new(IdleMode::Backoff, 0, 0, 5_000, fd);
        i.park(&mut Vec::new(), None);
        assert!(t.elapsed() < std::time::Duration::from_secs(1));
    }

    #[test]
    fn spin_never_parks() {
        let fd = Arc::new(shm_api::sys::eventfd().unwrap());
        let mut i = Idle::new(IdleMode::Spin, 0, 0, 1, fd);
        assert!((0..100_000).all(|_| !i.idle(0)));
    }
}

//! The engine's timers with their earliest deadline cached: the I/O layer asks
//! [`super::Connection::poll_timeout`] for every connection every pass, and a scan of every
//! timer cost ~80 of an empty DPDK pass's ~1009 instructions (issue 17). The fields are private
//! to this module, so every write goes through a setter that keeps the cache exact.

use crate::time::Instant;
use crate::wire::MAX_PATHS;

/// A liveness check: which up paths still wait for the pong to their liveness ping, and until
/// when. One ping per path at most is outstanding, so the first pong to
/// [`crate::wire::LIVENESS_PORT`] on a waiting path answers it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Liveness {
    pub deadline: Instant,
    pub waiting: [bool; MAX_PATHS],
}

#[derive(Debug)]
pub(super) struct Timers {
    /// Active side: per path, when to try connecting again (backoff).
    reconnect_at: [Option<Instant>; MAX_PATHS],
    /// Passive side: the doorbell timer, when one is armed.
    doorbell_at: Option<Instant>,
    /// Data on path 0 waits for the first pong on this path-0 connection, until this
    /// deadline at the latest (see `Connection::path_up`); control messages go first.
    path0_gate: Option<Instant>,
    /// Passive side: the liveness check in progress (see `Connection::handle_accepted`).
    liveness: Option<Liveness>,
    /// The earliest of all the above: always equal to [`Timers::scan`].
    next: Option<Instant>,
}

impl Timers {
    pub fn new() -> Self {
        Timers {
            reconnect_at: [None; MAX_PATHS],
            doorbell_at: None,
            path0_gate: None,
            liveness: None,
            next: None,
        }
    }

    /// The earliest deadline (O(1)).
    #[inline]
    pub fn next(&self) -> Option<Instant> {
        debug_assert_eq!(self.next, self.scan(), "cached deadline out of date");
        self.next
    }

    /// The earliest deadline, from every timer.
    fn scan(&self) -> Option<Instant> {
        self.reconnect_at
            .iter()
            .flatten()
            .copied()
            .chain(self.doorbell_at)
            .chain(self.path0_gate)
            .chain(self.liveness.map(|l| l.deadline))
            .min()
    }

    /// One timer went from `old` to `new` (they differ).
    fn update(&mut self, old: Option<Instant>, new: Option<Instant>) {
        match (new, self.next) {
            // Earlier than every other timer (none of them is below `next`).
            (Some(n), Some(next)) if n < next => self.next = new,
            (Some(_), None) => self.next = new,
            // It may have been the earliest: the next one is among the others.
            _ if old.is_some() && old == self.next => self.next = self.scan(),
            // Neither it nor its old value is the earliest.
            _ => {}
        }
    }

    #[inline]
    pub fn reconnect_at(&self, path: usize) -> Option<Instant> {
        self.reconnect_at[path]
    }

    #[inline]
    pub fn set_reconnect_at(&mut self, path: usize, at: Option<Instant>) {
        let old = self.reconnect_at[path];
        if old != at {
            self.reconnect_at[path] = at;
            self.update(old, at);
        }
    }

    #[inline]
    pub fn doorbell_at(&self) -> Option<Instant> {
        self.doorbell_at
    }

    #[inline]
    pub fn set_doorbell_at(&mut self, at: Option<Instant>) {
        let old = self.doorbell_at;
        // Compared before written: `send` clears the doorbell timer every message.
        if old != at {
            self.doorbell_at = at;
            self.update(old, at);
        }
    }

    #[inline]
    pub fn path0_gate(&self) -> Option<Instant> {
        self.path0_gate
    }

    #[inline]
    pub fn set_path0_gate(&mut self, at: Option<Instant>) {
        let old = self.path0_gate;
        if old != at {
            self.path0_gate = at;
            self.update(old, at);
        }
    }

    #[inline]
    pub fn liveness(&self) -> Option<Liveness> {
        self.liveness
    }

    #[inline]
    pub fn set_liveness(&mut self, check: Option<Liveness>) {
        let old = std::mem::replace(&mut self.liveness, check).map(|l| l.deadline);
        let new = check.map(|l| l.deadline);
        if old != new {
            self.update(old, new);
        }
    }

    /// `path` no longer waits for its liveness pong; the check ends once no path waits.
    /// Returns whether it waited.
    pub fn liveness_path_done(&mut self, path: usize) -> bool {
        let Some(check) = self.liveness.as_mut().filter(|l| l.waiting[path]) else {
            return false;
        };
        check.waiting[path] = false;
        if !check.waiting.iter().any(|&w| w) {
            self.set_liveness(None);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;

    /// Random writes to every timer, few distinct instants (ties, equal rewrites): the cached
    /// deadline is the scan's after each.
    #[test]
    fn cached_deadline_is_the_earliest_timer() {
        let mut rng = SplitMix64::new(17);
        let mut t = Timers::new();
        for _ in 0..200_000 {
            let at = match rng.below(5) {
                0 => None,
                n => Some(Instant::from_nanos(rng.below(4 * n))),
            };
            match rng.below(5) {
                0 | 1 => t.set_reconnect_at(rng.below(MAX_PATHS as u64) as usize, at),
                2 => t.set_doorbell_at(at),
                3 => t.set_path0_gate(at),
                _ => match at {
                    Some(deadline) if rng.below(2) == 0 => {
                        let mut waiting = [false; MAX_PATHS];
                        waiting[rng.below(MAX_PATHS as u64) as usize] = true;
                        waiting[rng.below(MAX_PATHS as u64) as usize] = true;
                        t.set_liveness(Some(Liveness { deadline, waiting }));
                    }
                    Some(_) => {
                        t.liveness_path_done(rng.below(MAX_PATHS as u64) as usize);
                    }
                    None => t.set_liveness(None),
                },
            }
            assert_eq!(t.next, t.scan());
        }
    }
}

//! What proves a poll thread quiet in steady state (ARCHITECTURE.md, invariant "Quiet fast
//! path"): per-thread counts of heap allocations ([`CountingAlloc`], installed by rdsd's
//! binary) and of rdsd's own locks taken ([`Mutex`]). Each poll thread publishes both with its
//! counters (`poll_allocations`, `poll_locks`), so a test or an operator sees whether a
//! workload makes any: `tests/tests/quiet.rs` runs steady traffic and checks that neither
//! moves (and, with strace, that no system call is made). A leaf module: std only.

mod alloc;

pub use alloc::{allocations, CountingAlloc};

use std::cell::Cell;

thread_local! {
    /// Locks this thread took through [`Mutex::lock`].
    static LOCKS: Cell<u64> = const { Cell::new(0) };
}

/// [`Mutex::lock`] calls this thread made so far.
pub fn locks() -> u64 {
    LOCKS.with(Cell::get)
}

/// `std::sync::Mutex` that counts, per thread, how often it is locked: every mutex a poll
/// thread may take is one of these, so `poll_locks` says whether steady state takes any
/// (none: they guard binds, connection placement and attach-time state only).
#[derive(Debug, Default)]
pub struct Mutex<T>(std::sync::Mutex<T>);

impl<T> Mutex<T> {
    pub const fn new(value: T) -> Self {
        Mutex(std::sync::Mutex::new(value))
    }

    /// Locks it; a holder that panicked poisoned nothing we rely on (each guarded value is
    /// left consistent between statements), so the poison is ignored.
    pub fn lock(&self) -> std::sync::MutexGuard<'_, T> {
        let _ = LOCKS.try_with(|c| c.set(c.get() + 1));
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locks_are_counted_per_thread() {
        let m = Mutex::new(1);
        let before = locks();
        *m.lock() += 1;
        *m.lock() += 1;
        assert_eq!(locks() - before, 2);
        std::thread::scope(|s| {
            s.spawn(|| {
                assert_eq!(locks(), 0, "a fresh thread has taken none");
                let _g = m.lock();
                assert_eq!(locks(), 1);
            });
        });
        assert_eq!(locks() - before, 2, "another thread's lock is not ours");
        assert_eq!(*m.lock(), 3);
    }
}

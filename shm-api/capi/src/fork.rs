//! The process's fork generation: bumped in the child of every fork, so that what a parent
//! made (sockets, reader records of threads the child does not have) is told apart.

use std::sync::atomic::{AtomicU64, Ordering};

static FORK_GEN: AtomicU64 = AtomicU64::new(0);

/// Bumped in the child of every fork (once [`watch`] ran).
pub fn fork_generation() -> u64 {
    FORK_GEN.load(Ordering::Relaxed)
}

extern "C" fn after_fork_in_child() {
    FORK_GEN.fetch_add(1, Ordering::Relaxed);
}

/// Starts counting forks (idempotent).
pub fn watch() {
    static ATFORK: std::sync::Once = std::sync::Once::new();
    ATFORK.call_once(|| {
        // SAFETY: registers a handler that only bumps an atomic (async-signal-safe).
        unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
    });
}

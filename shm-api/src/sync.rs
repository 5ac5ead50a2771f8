//! Atomics used by the cross-process rings, swapped for loom's under `cfg(loom)`
//! so the model checker sees every access.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU64, Ordering};

//! Test-only fault hooks, armed through `RDSD_TEST_*` environment variables in an rdsd built
//! with the `fault-injection` cargo feature (the integration tests build one into
//! `target/fault-injection/`, see `rdsd_tests::rdsd_fault_bin`). Without the feature, the
//! default and release builds, every hook is `None` and no variable is read.

use std::time::Duration;

/// `RDSD_TEST_STALL_POLL_MS=N`: a `SetRcvBuf` of exactly `shm_api::ctrl::TEST_STALL_RCVBUF`
/// bytes makes the poll core sleep N ms before answering (a slow poll core, on demand).
#[cfg(feature = "fault-injection")]
pub fn poll_stall() -> Option<Duration> {
    let ms: u64 = std::env::var("RDSD_TEST_STALL_POLL_MS")
        .ok()?
        .parse()
        .ok()?;
    tracing::warn!(
        ms,
        "RDSD_TEST_STALL_POLL_MS is set: test-only stall hook armed"
    );
    Some(Duration::from_millis(ms))
}

/// Without the `fault-injection` feature: never armed.
#[cfg(not(feature = "fault-injection"))]
pub fn poll_stall() -> Option<Duration> {
    None
}

/// `RDSD_TEST_RDMA_QP_ERROR_EVERY=N` (N > 0): every N-th new frame the RDMA link writes moves
/// its path's QP to the error state, mid-stream.
#[cfg(feature = "fault-injection")]
pub fn rdma_qp_error_every() -> Option<u64> {
    let n: u64 = std::env::var("RDSD_TEST_RDMA_QP_ERROR_EVERY")
        .ok()?
        .parse()
        .ok()
        .filter(|&n| n > 0)?;
    tracing::warn!(
        every = n,
        "RDSD_TEST_RDMA_QP_ERROR_EVERY is set: test-only QP error injection armed"
    );
    Some(n)
}

/// Without the `fault-injection` feature: never armed.
#[cfg(not(feature = "fault-injection"))]
pub fn rdma_qp_error_every() -> Option<u64> {
    None
}

/// `RDSD_TEST_DIE_IN_FANOUT=N` (N > 0): a crash in the middle of a fan-out, on demand. Counted
/// per poll thread: shard 0 kills rdsd (SIGKILL) at the N-th fan-out of two or more copies,
/// right after publishing its first local copy; another poll thread at the N-th group copy it
/// publishes for shard 0, right after that publish.
#[cfg(feature = "fault-injection")]
pub fn die_in_fanout() -> Option<u64> {
    let n: u64 = std::env::var("RDSD_TEST_DIE_IN_FANOUT")
        .ok()?
        .parse()
        .ok()
        .filter(|&n| n > 0)?;
    tracing::warn!(
        fanout = n,
        "RDSD_TEST_DIE_IN_FANOUT is set: test-only crash in a fan-out armed"
    );
    Some(n)
}

/// Without the `fault-injection` feature: never armed.
#[cfg(not(feature = "fault-injection"))]
pub fn die_in_fanout() -> Option<u64> {
    None
}

/// `RDSD_TEST_STALL_IN_FANOUT=PATH`: while the file PATH exists, a multicast fan-out of two
/// or more copies stops right after publishing the first (on shard 0; on another poll thread
/// after each group copy it publishes)
/// (the poll thread sleeps in 1 ms steps): a fan-out held open between publish and commit
/// for as long as a test needs.
#[cfg(feature = "fault-injection")]
pub fn stall_in_fanout() -> Option<std::path::PathBuf> {
    let p = std::env::var_os("RDSD_TEST_STALL_IN_FANOUT")?;
    tracing::warn!(
        path = ?p,
        "RDSD_TEST_STALL_IN_FANOUT is set: test-only fan-out stall armed"
    );
    Some(p.into())
}

/// Without the `fault-injection` feature: never armed.
#[cfg(not(feature = "fault-injection"))]
pub fn stall_in_fanout() -> Option<std::path::PathBuf> {
    None
}

/// Kills this process as a crash would: no destructor, no flush, nothing after.
pub fn die_now() -> ! {
    // SAFETY: plain syscalls on our own process.
    unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
    std::process::abort()
}

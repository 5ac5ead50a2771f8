//! Test-only fault hooks, armed with `--fault NAME=VALUE` on the command line of an rdsd built
//! with the `fault-injection` cargo feature (the integration tests build one into
//! `target/fault-injection/`, see `rdsd_tests::rdsd_fault_bin`). Without the feature, the
//! default and release builds, the flag does not exist and every hook is `None`.
//!
//! The hooks:
//! - `stall-poll-ms=N`: a `SetRcvBuf` of exactly `shm_api::ctrl::TEST_STALL_RCVBUF` bytes makes
//!   the poll core sleep N ms before answering (a slow poll core, on demand).
//! - `rdma-qp-error-every=N` (N > 0): every N-th new frame the RDMA link writes moves its path's
//!   QP to the error state, mid-stream.
//! - `die-in-fanout=N` (N > 0): a crash in the middle of a fan-out. Counted per poll thread:
//!   shard 0 kills rdsd (SIGKILL) at the N-th fan-out of two or more copies, right after
//!   publishing its first local copy; another poll thread at the N-th group copy it publishes
//!   for shard 0, right after that publish.
//! - `stall-in-fanout=PATH`: while the file PATH exists, a multicast fan-out of two or more
//!   copies stops right after publishing the first (on shard 0; on another poll thread after
//!   each group copy it publishes; the poll thread sleeps in 1 ms steps): a fan-out held open
//!   between publish and commit for as long as a test needs.

use std::path::PathBuf;
use std::time::Duration;

/// The armed hooks (all `None` unless `--fault` armed them).
#[derive(Debug, Default)]
#[cfg_attr(not(feature = "fault-injection"), allow(dead_code))]
struct Faults {
    stall_poll: Option<Duration>,
    rdma_qp_error_every: Option<u64>,
    die_in_fanout: Option<u64>,
    stall_in_fanout: Option<PathBuf>,
}

#[cfg(feature = "fault-injection")]
static FAULTS: std::sync::OnceLock<Faults> = std::sync::OnceLock::new();

/// Arms the hooks `specs` name (`NAME=VALUE` each), once, before `run`.
#[cfg(feature = "fault-injection")]
pub fn arm(specs: &[String]) -> anyhow::Result<()> {
    use anyhow::{anyhow, bail, Context};
    let count = |v: &str| -> anyhow::Result<u64> {
        v.parse::<u64>()
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| anyhow!("{v:?} is not a count above 0"))
    };
    let mut f = Faults::default();
    for spec in specs {
        let (name, value) = spec
            .split_once('=')
            .ok_or_else(|| anyhow!("--fault {spec:?}: NAME=VALUE"))?;
        let r: anyhow::Result<()> = (|| {
            match name {
                "stall-poll-ms" => f.stall_poll = Some(Duration::from_millis(value.parse()?)),
                "rdma-qp-error-every" => f.rdma_qp_error_every = Some(count(value)?),
                "die-in-fanout" => f.die_in_fanout = Some(count(value)?),
                "stall-in-fanout" => f.stall_in_fanout = Some(value.into()),
                _ => bail!(
                    "unknown hook (stall-poll-ms, rdma-qp-error-every, die-in-fanout, \
                     stall-in-fanout)"
                ),
            }
            Ok(())
        })();
        r.with_context(|| format!("--fault {spec:?}"))?;
        tracing::warn!(hook = %spec, "test-only fault hook armed");
    }
    FAULTS
        .set(f)
        .map_err(|_| anyhow!("fault hooks are armed once"))
}

/// The armed hooks; none in a build without the feature.
fn faults() -> Option<&'static Faults> {
    #[cfg(feature = "fault-injection")]
    return FAULTS.get();
    #[cfg(not(feature = "fault-injection"))]
    None
}

/// `stall-poll-ms`.
pub fn poll_stall() -> Option<Duration> {
    faults()?.stall_poll
}

/// `rdma-qp-error-every`.
pub fn rdma_qp_error_every() -> Option<u64> {
    faults()?.rdma_qp_error_every
}

/// `die-in-fanout`.
pub fn die_in_fanout() -> Option<u64> {
    faults()?.die_in_fanout
}

/// `stall-in-fanout`.
pub fn stall_in_fanout() -> Option<PathBuf> {
    faults()?.stall_in_fanout.clone()
}

/// Kills this process as a crash would: no destructor, no flush, nothing after.
pub fn die_now() -> ! {
    // SAFETY: plain syscalls on our own process.
    unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
    std::process::abort()
}

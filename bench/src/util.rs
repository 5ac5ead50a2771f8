//! CPU pinning, waiting helpers and result formatting shared by the benchmarks.

use anyhow::{bail, Result};
use hdrhistogram::Histogram;
use std::io;
use std::time::Duration;

/// Give up when a peer makes no progress for this long.
pub const STALL_LIMIT: Duration = Duration::from_secs(10);

/// Nanoseconds of CLOCK_MONOTONIC (the same clock in every process of the host, and in every
/// network namespace).
/// The clock of the hop-trace stamps (`shm_api::hoptrace`), so the two always agree.
#[inline]
pub fn mono_ns() -> u64 {
    shm_api::hoptrace::now_ns()
}

/// The CPUs this process may run on, read once, by `main` before any thread pins itself (a
/// thread's own mask narrows once it is pinned): the set rdsd resolves its `-1` against too.
pub fn process_cpus() -> &'static [usize] {
    static CPUS: std::sync::OnceLock<Vec<usize>> = std::sync::OnceLock::new();
    CPUS.get_or_init(shm_api::sys::affinity_cpus)
}

/// rdsd's core numbering: -1 = the last CPU of the process's set, -3 = the first, -2 (or any
/// other negative) = don't pin.
pub fn resolve_core(n: i64) -> Option<usize> {
    match n {
        -1 => process_cpus().last().copied(),
        -3 => process_cpus().first().copied(),
        n if n < 0 => None,
        n => Some(n as usize),
    }
}

/// Checks that `core` is one this process may run on before any thread tries to pin to it.
pub fn check_core(what: &str, core: Option<usize>) -> Result<()> {
    if let Some(c) = core {
        let cpus = process_cpus();
        if !cpus.contains(&c) {
            bail!(
                "{what} CPU {c} is not one this process may run on (its CPUs: {})",
                cpus.iter()
                    .map(|c| c.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            );
        }
    }
    Ok(())
}

/// Pins the calling thread to `core`, or lets it run anywhere with `None`. A failure is only
/// a warning: the numbers are still valid, just noisier.
pub fn pin(core: Option<usize>) {
    match core {
        Some(c) => {
            if !core_affinity::set_for_current(core_affinity::CoreId { id: c }) {
                eprintln!(
                    "rds-bench: warning: could not pin a thread to CPU {c}; running unpinned"
                );
            }
        }
        None => unpin(),
    }
}

/// Lets the calling thread run on every CPU of the process's set (undoes an affinity inherited
/// from a pinned parent thread).
fn unpin() {
    // SAFETY: cpu_set_t is a plain bit array; all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &i in process_cpus()
        .iter()
        .filter(|&&i| i < libc::CPU_SETSIZE as usize)
    {
        // SAFETY: `i` is below CPU_SETSIZE, so the bit lies inside `set`.
        unsafe { libc::CPU_SET(i, &mut set) };
    }
    // SAFETY: `set` is a valid cpu_set_t of the size passed; pid 0 is the calling thread.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if rc != 0 {
        eprintln!(
            "rds-bench: warning: could not reset CPU affinity: {}",
            io::Error::last_os_error()
        );
    }
}

/// EAGAIN / ENOBUFS: try again later.
pub fn would_block(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::ENOBUFS))
}

/// Busy-wait policy: spin, and with `yield_every` > 0 give the CPU away every so many misses
/// (needed when two busy threads share one core).
pub struct Backoff {
    misses: u32,
    yield_every: u32,
    until_yield: u32,
}

impl Backoff {
    /// Spin `n` times, then `sched_yield` (0 = spin only).
    pub fn yielding(n: u32) -> Backoff {
        Backoff {
            misses: 0,
            yield_every: n,
            until_yield: n,
        }
    }

    /// One miss.
    #[inline]
    pub fn snooze(&mut self) {
        self.misses = self.misses.wrapping_add(1);
        if self.yield_every != 0 {
            self.until_yield -= 1;
            if self.until_yield == 0 {
                self.until_yield = self.yield_every;
                std::thread::yield_now();
                return;
            }
        }
        std::hint::spin_loop();
    }

    /// True every 1024 misses: time to check clocks and abort flags.
    #[inline]
    pub fn should_check(&self) -> bool {
        self.misses & 1023 == 0
    }
}

/// A histogram for nanosecond latencies from 1 ns to an hour.
pub fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000_000, 3).expect("valid histogram bounds")
}

/// Latency figures of one run.
#[derive(Clone, Debug)]
pub struct Latency {
    pub p50: u64,
    pub p99: u64,
    pub p999: u64,
    pub max: u64,
    pub mean: f64,
    pub count: u64,
    /// Round trips per second over the measured part.
    pub rate: f64,
}

impl Latency {
    pub fn from_histogram(h: &Histogram<u64>, elapsed: Duration) -> Latency {
        Latency {
            p50: h.value_at_quantile(0.50),
            p99: h.value_at_quantile(0.99),
            p999: h.value_at_quantile(0.999),
            max: h.max(),
            mean: h.mean(),
            count: h.len(),
            rate: h.len() as f64 / elapsed.as_secs_f64().max(1e-9),
        }
    }
}

/// Throughput figures of one run.
#[derive(Clone, Debug)]
pub struct Throughput {
    pub count: u64,
    pub size: usize,
    /// Receiver's first to last message.
    pub elapsed: Duration,
    /// Sends that found no room and were retried.
    pub retries: u64,
}

impl Throughput {
    pub fn msgs_per_s(&self) -> f64 {
        self.count.saturating_sub(1) as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    pub fn mb_per_s(&self) -> f64 {
        self.msgs_per_s() * self.size as f64 / 1e6
    }
}

/// `1.23 µs`, `45.6 µs`, `7.89 ms`.
pub fn fmt_ns(ns: f64) -> String {
    if ns < 10_000.0 {
        format!("{:.2} µs", ns / 1e3)
    } else if ns < 1_000_000.0 {
        format!("{:.1} µs", ns / 1e3)
    } else {
        format!("{:.2} ms", ns / 1e6)
    }
}

/// `1.23 M`, `456.7 k`.
pub fn fmt_rate(r: f64) -> String {
    if r >= 1e6 {
        format!("{:.2} M", r / 1e6)
    } else if r >= 1e3 {
        format!("{:.1} k", r / 1e3)
    } else {
        format!("{r:.0}")
    }
}

/// Writes a sequence number into the first 8 bytes of a payload (if it has 8).
#[inline]
pub fn stamp(buf: &mut [u8], seq: u64) {
    if buf.len() >= 8 {
        buf[..8].copy_from_slice(&seq.to_le_bytes());
    }
}

/// Checks that a received payload has the expected length and sequence number.
#[inline]
pub fn check_payload(buf: &[u8], n: usize, size: usize, seq: u64) -> Result<()> {
    if n != size {
        bail!("message {seq}: received {n} bytes, expected {size}");
    }
    if size >= 8 {
        let got = u64::from_le_bytes(buf[..8].try_into().expect("8 bytes"));
        if got != seq {
            bail!("message {seq}: got sequence number {got} (lost, duplicated or reordered)");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cores_and_formatting() {
        assert_eq!(resolve_core(-2), None);
        let cpus = process_cpus();
        assert_eq!(resolve_core(-1), cpus.last().copied());
        assert_eq!(resolve_core(-3), cpus.first().copied());
        assert_eq!(resolve_core(3), Some(3));
        assert!(check_core("x", Some(cpus[cpus.len() - 1] + 1)).is_err());
        assert!(check_core("x", Some(cpus[0])).is_ok());
        assert_eq!(fmt_ns(1234.0), "1.23 µs");
        assert_eq!(fmt_ns(45_600.0), "45.6 µs");
        assert_eq!(fmt_ns(7_890_000.0), "7.89 ms");
        assert_eq!(fmt_rate(5_120_000.0), "5.12 M");
    }

    #[test]
    fn payload_checks() {
        let mut b = vec![0u8; 64];
        stamp(&mut b, 42);
        assert!(check_payload(&b, 64, 64, 42).is_ok());
        assert!(check_payload(&b, 64, 64, 41).is_err());
        assert!(check_payload(&b, 63, 64, 42).is_err());
        let short = [1u8; 4];
        assert!(
            check_payload(&short, 4, 4, 7).is_ok(),
            "short payloads carry no sequence number"
        );
    }

    #[test]
    fn throughput_math() {
        let t = Throughput {
            count: 1_000_001,
            size: 64,
            elapsed: Duration::from_millis(200),
            retries: 0,
        };
        assert!((t.msgs_per_s() - 5e6).abs() < 1.0);
        assert!((t.mb_per_s() - 320.0).abs() < 1e-6);
    }
}

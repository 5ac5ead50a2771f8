//! `rds-bench blocking`: what an application that sleeps in `recv` sees, with rdsd on its
//! default (backoff) idle strategy (or `--idle watch`), next to AF_UNIX SOCK_SEQPACKET between
//! two processes in the same run:
//!
//! 1. the 64 B round trip between two processes that block in recv;
//! 2. the wake-up latency of a blocked receiver after rdsd has been idle (parked): the sender
//!    stamps CLOCK_MONOTONIC into the message, the receiver reports how long after that it
//!    returned from recv;
//! 3. rdsd's CPU use while idle, alone and with a receiver blocked in recv.

use crate::daemon::{counter, Target};
use crate::rds::bound_socket;
use crate::unix;
use crate::util::{fmt_ns, fmt_rate, mono_ns, new_histogram, Latency};
use anyhow::{bail, Context, Result};
use shm_api::Rdsd;
use std::io::{BufRead, BufReader, Write};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// CPU ticks (user + system) of a process, from /proc.
fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let f: Vec<u64> = stat
        .rsplit(')')
        .next()?
        .split_whitespace()
        .map(|v| v.parse().unwrap_or(0))
        .collect();
    Some(f.get(11)? + f.get(12)?)
}

/// rdsd's CPU use over `secs`, in percent of one core.
fn cpu_percent(pid: u32, secs: f64) -> Result<f64> {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let before = cpu_ticks(pid).context("cannot read rdsd's /proc stat")?;
    let t = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(secs));
    let after = cpu_ticks(pid).context("cannot read rdsd's /proc stat")?;
    Ok(100.0 * (after - before) as f64 / hz / t.elapsed().as_secs_f64())
}

/// `__rds-wake`: binds, prints `port N`, then for every message replies with the nanoseconds
/// between the sender's CLOCK_MONOTONIC stamp (first 8 bytes) and its own return from recv.
pub fn wake_echo_main(socket: &std::path::Path) -> Result<()> {
    let rdsd = Rdsd::attach_at(socket)
        .with_context(|| format!("wake: cannot attach to {}", socket.display()))?;
    let (s, addr) = bound_socket(&rdsd)?;
    s.set_recv_timeout(Some(Duration::from_secs(30)))?;
    println!("port {}", addr.port());
    std::io::stdout().flush()?;
    let mut buf = [0u8; 64];
    loop {
        let (n, from) = s.recv_from(&mut buf).context("wake: recv")?;
        let woke = mono_ns();
        if n < 8 {
            return Ok(());
        }
        let sent = u64::from_le_bytes(buf[..8].try_into().expect("8 bytes"));
        s.send_to(&woke.saturating_sub(sent).to_le_bytes(), from)?;
    }
}

/// Wake-up latency of a receiver blocked in recv, sampled every `gap` (long enough for rdsd to
/// park). Returns the latencies and how many samples found rdsd parked.
fn wake_latency(
    rdsd: &Rdsd,
    socket: &std::path::Path,
    samples: u32,
    gap: Duration,
) -> Result<(Latency, u64)> {
    let mut child = Command::new(std::env::current_exe()?)
        .arg("__rds-wake")
        .arg("--socket")
        .arg(socket)
        .stdout(Stdio::piped())
        .spawn()
        .context("cannot start the wake-up receiver")?;
    let res = (|| -> Result<(Latency, u64)> {
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line)?;
        let port: u16 = line
            .strip_prefix("port ")
            .and_then(|p| p.trim().parse().ok())
            .with_context(|| format!("wake receiver said {line:?}"))?;
        let peer = SocketAddrV4::new(Ipv4Addr::LOCALHOST, port);
        let (s, _) = bound_socket(rdsd)?;
        s.set_recv_timeout(Some(Duration::from_secs(10)))?;
        let mut hist = new_histogram();
        let parks0 = counter(&rdsd.stats()?, "poll_parks");
        let start = Instant::now();
        let mut buf = [0u8; 64];
        for _ in 0..samples {
            std::thread::sleep(gap);
            s.send_to(&mono_ns().to_le_bytes(), peer)?;
            let (n, _) = s
                .recv_from(&mut buf)
                .context("no wake-up report within 10 s")?;
            if n != 8 {
                bail!("wake receiver replied {n} bytes");
            }
            hist.saturating_record(u64::from_le_bytes(buf[..8].try_into()?).max(1));
        }
        let parks = counter(&rdsd.stats()?, "poll_parks") - parks0;
        s.send_to(&[], peer)?;
        Ok((Latency::from_histogram(&hist, start.elapsed()), parks))
    })();
    if res.is_err() {
        let _ = child.kill();
    }
    let _ = child.wait();
    res
}

/// The same wake-up measurement over an AF_UNIX SOCK_SEQPACKET pair: a receiver thread blocked
/// in recv, one kernel wake-up per sample (rdsd's path has two, the poll core's and the app's,
/// where the poll core parked; with `--idle watch` it does not park while the receiver sleeps).
fn unix_wake_latency(samples: u32, gap: Duration) -> Result<Latency> {
    let (a, b) = unix::seqpacket_pair()?;
    let receiver = std::thread::spawn(move || -> Result<()> {
        use std::os::fd::AsRawFd;
        let mut buf = [0u8; 64];
        loop {
            // SAFETY: recv into our own buffer on a descriptor this thread owns.
            let n = unsafe { libc::recv(b.as_raw_fd(), buf.as_mut_ptr() as *mut _, 64, 0) };
            let woke = mono_ns();
            if n < 8 {
                return Ok(());
            }
            let sent = u64::from_le_bytes(buf[..8].try_into().expect("8 bytes"));
            let reply = woke.saturating_sub(sent).to_le_bytes();
            // SAFETY: send from our own buffer.
            unsafe { libc::send(b.as_raw_fd(), reply.as_ptr() as *const _, 8, 0) };
        }
    });
    use std::os::fd::AsRawFd;
    let fd = a.as_raw_fd();
    let mut hist = new_histogram();
    let start = Instant::now();
    let mut buf = [0u8; 64];
    for _ in 0..samples {
        std::thread::sleep(gap);
        let stamp = mono_ns().to_le_bytes();
        // SAFETY: send/recv with our own buffers on our own descriptor.
        let n = unsafe {
            libc::send(fd, stamp.as_ptr() as *const _, 8, 0);
            libc::recv(fd, buf.as_mut_ptr() as *mut _, 64, 0)
        };
        if n != 8 {
            bail!("AF_UNIX wake receiver replied {n} bytes");
        }
        hist.saturating_record(u64::from_le_bytes(buf[..8].try_into()?).max(1));
    }
    drop(a);
    let _ = receiver.join();
    Ok(Latency::from_histogram(&hist, start.elapsed()))
}

/// Arguments of `rds-bench blocking`.
#[derive(clap::Args)]
pub struct BlockingArgs {
    #[command(flatten)]
    pub daemon: crate::daemon::DaemonArgs,
    /// Measured round trips.
    #[arg(long, default_value_t = 20_000)]
    pub count: u64,
    /// Wake-up samples (one every --wake-gap-ms).
    #[arg(long, default_value_t = 200)]
    pub wake_samples: u32,
    /// Idle time before each wake-up sample, in ms (longer than rdsd's spin + yield phases,
    /// so that it has parked).
    #[arg(long, default_value_t = 60)]
    pub wake_gap_ms: u64,
    /// Seconds over which idle CPU is measured.
    #[arg(long, default_value_t = 3.0)]
    pub idle_secs: f64,
}

fn row(name: &str, l: &Latency) {
    println!(
        "  {:<48} p50 {:>9}  p99 {:>9}  p99.9 {:>9}  {:>10} round trips/s",
        name,
        fmt_ns(l.p50 as f64),
        fmt_ns(l.p99 as f64),
        fmt_ns(l.p999 as f64),
        fmt_rate(l.rate)
    );
}

pub fn cmd(mut a: BlockingArgs) -> Result<()> {
    a.daemon.idle.get_or_insert_with(|| "backoff".into());
    let target = Target::open(&a.daemon)?;
    let rdsd = target.attach()?;
    println!("rds-bench blocking: {}", target.describe());
    let size = 64;

    // 1. Round trip between two processes that sleep in recv.
    crate::rds::two_process_rtt(&rdsd, target.socket(), 1_000, size)?;
    let r = crate::rds::two_process_rtt(&rdsd, target.socket(), a.count, size)?;

    // 2. Wake-up after rdsd parked.
    let (w, parks) = wake_latency(
        &rdsd,
        target.socket(),
        a.wake_samples,
        Duration::from_millis(a.wake_gap_ms),
    )?;

    // 3. Idle CPU, with and without a receiver blocked in recv.
    let idle = match target.pid() {
        Some(pid) => {
            let alone = cpu_percent(pid, a.idle_secs)?;
            let mut child = Command::new(std::env::current_exe()?)
                .arg("__rds-wake")
                .arg("--socket")
                .arg(target.socket())
                .stdout(Stdio::piped())
                .spawn()?;
            let mut line = String::new();
            BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line)?;
            let blocked = cpu_percent(pid, a.idle_secs);
            let _ = child.kill();
            let _ = child.wait();
            Some((alone, blocked?))
        }
        None => None,
    };
    drop(rdsd);
    target.stop()?;

    // AF_UNIX SOCK_SEQPACKET between two processes, blocking: unpinned and both on CPU 0.
    let u_any = unix::rtt(a.count, 1_000, size, None, None, false)?;
    let pinned = core_affinity::set_for_current(core_affinity::CoreId { id: 0 });
    let u_same = unix::rtt(a.count, 1_000, size, Some(0), Some(0), false)?;
    let uw = unix_wake_latency(a.wake_samples, Duration::from_millis(a.wake_gap_ms))?;
    let best = if u_same.p50 < u_any.p50 && pinned {
        &u_same
    } else {
        &u_any
    };

    println!("64 B round trip, two processes blocking in recv:");
    row("rdsd (two processes, unpinned)", &r);
    row("AF_UNIX seqpacket, unpinned", &u_any);
    row("AF_UNIX seqpacket, both on CPU 0", &u_same);
    let ratio = r.p50 as f64 / best.p50 as f64;
    println!(
        "  ratio rdsd p50 / best AF_UNIX p50: {ratio:.2}  (target <= 0.5; p99 {} vs {})",
        fmt_ns(r.p99 as f64),
        fmt_ns(best.p99 as f64)
    );
    println!(
        "wake-up of a receiver blocked in recv after {} ms idle ({} samples, rdsd parked {} times):",
        a.wake_gap_ms, a.wake_samples, parks
    );
    println!(
        "  rdsd:    p50 {}  p99 {}  max {}  (target p99 <= 50 µs)",
        fmt_ns(w.p50 as f64),
        fmt_ns(w.p99 as f64),
        fmt_ns(w.max as f64)
    );
    println!(
        "  AF_UNIX: p50 {}  p99 {}  max {}  (one kernel wake-up; rdsd's path has two where its poll thread parked)",
        fmt_ns(uw.p50 as f64),
        fmt_ns(uw.p99 as f64),
        fmt_ns(uw.max as f64)
    );
    if let Some((alone, blocked)) = idle {
        println!(
            "idle rdsd CPU over {} s: {alone:.2}% alone, {blocked:.2}% with a receiver blocked in recv (target <= 1%)",
            a.idle_secs
        );
        println!("RESULT idle cpu_alone_pct={alone:.3} cpu_blocked_pct={blocked:.3}");
    }
    println!(
        "RESULT blocking rdsd_p50_ns={} rdsd_p99_ns={} unix_best_p50_ns={} unix_best_p99_ns={} ratio_p50={ratio:.3}",
        r.p50, r.p99, best.p50, best.p99
    );
    println!(
        "RESULT wake_unix p50_ns={} p99_ns={} max_ns={}",
        uw.p50, uw.p99, uw.max
    );
    println!(
        "RESULT wake p50_ns={} p99_ns={} max_ns={} parks={parks}",
        w.p50, w.p99, w.max
    );
    Ok(())
}

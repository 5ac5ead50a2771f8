//! `rds-bench`: latency and throughput of rdsd's loopback path, next to an AF_UNIX
//! SOCK_SEQPACKET baseline measured in the same run.
//!
//! ```text
//! rds-bench rtt  [--socket PATH | --spawn-rdsd RDSD] [--count N] [--warmup N] [--size B] [--app-core C]
//! rds-bench tput [--socket PATH | --spawn-rdsd RDSD] [--count N] [--size B] [--app-core C]
//! rds-bench demo [--socket PATH | --spawn-rdsd RDSD]
//! rds-bench blocking [--socket PATH | --spawn-rdsd RDSD] [--count N] [--wake-samples N]
//! ```
//!
//! Without `--socket`, rds-bench starts the `rdsd` next to its own executable on a temporary
//! control socket (`--idle spin --poll-core <--poll-core> --control-core -2 --hugepages auto`)
//! and stops it at the end. A spawned rdsd is stopped *before* the baseline runs, so the
//! baseline gets the poll core to itself.
//!
//! Every run prints a table, then `RESULT key=value ...` lines for scripts.

mod blocking;
mod daemon;
mod rds;
mod unix;
mod util;

use anyhow::{bail, Result};
use clap::{Parser, Subcommand};
use daemon::{counter, DaemonArgs, Target};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;
use unix::Baseline;
use util::{check_core, fmt_ns, fmt_rate, resolve_core, Latency, Throughput};

/// Benchmarks for rdsd (userspace RDS), with an AF_UNIX SOCK_SEQPACKET baseline.
#[derive(Parser)]
#[command(version)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Round-trip latency: one thread ping-pongs between two rdsd sockets, busy-polling;
    /// then AF_UNIX SOCK_SEQPACKET ping-pong between two processes.
    Rtt(RttArgs),
    /// One-way throughput: a sender thread and a receiver thread, busy-polling; then the same
    /// over an AF_UNIX SOCK_SEQPACKET pair.
    Tput(TputArgs),
    /// A short tour that pushes real traffic through rdsd and prints what it saw.
    Demo(DemoArgs),
    /// Applications that sleep in recv: two-process blocking round trip next to AF_UNIX,
    /// wake-up latency after rdsd parked, idle CPU (rdsd on its default idle strategy).
    Blocking(blocking::BlockingArgs),
    /// (internal) wake-up receiver of `blocking`.
    #[command(name = "__rds-wake", hide = true)]
    RdsWake {
        #[arg(long)]
        socket: PathBuf,
    },
    /// (internal) AF_UNIX echo peer of `rtt`.
    #[command(name = "__unix-echo", hide = true)]
    UnixEcho {
        #[arg(long)]
        fd: i32,
        #[arg(long)]
        core: Option<usize>,
        #[arg(long)]
        spin: bool,
        #[arg(long, default_value_t = 0)]
        yield_every: u32,
    },
    /// (internal) rdsd echo peer of `demo`.
    #[command(name = "__rds-echo", hide = true)]
    RdsEcho {
        #[arg(long)]
        socket: PathBuf,
    },
}

#[derive(clap::Args)]
struct RttArgs {
    #[command(flatten)]
    daemon: DaemonArgs,
    /// Measured round trips.
    #[arg(long, default_value_t = 100_000)]
    count: u64,
    /// Round trips before measuring.
    #[arg(long, default_value_t = 10_000)]
    warmup: u64,
    /// Message size in bytes.
    #[arg(long, default_value_t = 64)]
    size: usize,
    /// CPU for the app thread (both baseline processes' parent too). Default: unpinned.
    #[arg(long)]
    app_core: Option<usize>,
    /// CPU of the baseline's echo process (-2 = unpinned); repeat to try several placements
    /// (the ratio uses the fastest). Default: the app core and the spawned rdsd's poll core
    /// (idle by then): same-core and cross-core ping-pong.
    #[arg(long, allow_hyphen_values = true)]
    peer_core: Vec<i64>,
    /// Which AF_UNIX baseline to run.
    #[arg(long, value_enum, default_value_t = Baseline::Block)]
    baseline: Baseline,
}

#[derive(clap::Args)]
struct TputArgs {
    #[command(flatten)]
    daemon: DaemonArgs,
    /// Messages to send.
    #[arg(long, default_value_t = 2_000_000)]
    count: u64,
    /// Message size in bytes.
    #[arg(long, default_value_t = 64)]
    size: usize,
    /// CPU of the sender thread, and of the rdsd receiver thread unless --receiver-core.
    #[arg(long)]
    app_core: Option<usize>,
    /// CPU of the rdsd receiver thread. Default: --app-core.
    #[arg(long)]
    receiver_core: Option<usize>,
    /// CPU of the baseline's receiver thread (-2 = unpinned); repeat to try several placements
    /// (the ratio uses the fastest). Default: the app core and the spawned rdsd's poll core
    /// (idle by then).
    #[arg(long, allow_hyphen_values = true)]
    peer_core: Vec<i64>,
    /// Which AF_UNIX baseline to run.
    #[arg(long, value_enum, default_value_t = Baseline::Block)]
    baseline: Baseline,
}

#[derive(clap::Args)]
struct DemoArgs {
    #[command(flatten)]
    daemon: DaemonArgs,
    /// Ping-pong round trips.
    #[arg(long, default_value_t = 20_000)]
    pings: u64,
    /// One-way burst size in messages.
    #[arg(long, default_value_t = 1_000_000)]
    burst: u64,
    /// Round trips with the second process.
    #[arg(long, default_value_t = 5_000)]
    exchanges: u64,
}

const TARGET_RTT_P50_NS: u64 = 2_000;
const TARGET_RTT_RATIO: f64 = 5.0;
const TARGET_TPUT: f64 = 5e6;

fn core_name(c: Option<usize>) -> String {
    c.map_or("unpinned".to_string(), |c| format!("CPU {c}"))
}

fn check_size(size: usize) -> Result<()> {
    if size > shm_api::layout::MAX_MSG_SIZE {
        bail!("--size {size} is above RDS's 1 MiB message limit");
    }
    Ok(())
}

fn lat_header() {
    println!(
        "  {:<54} {:>10} {:>10} {:>10} {:>10} {:>10} {:>14}",
        "", "p50", "p99", "p99.9", "max", "mean", "round trips/s"
    );
}

fn lat_row(name: &str, l: &Latency) {
    println!(
        "  {:<54} {:>10} {:>10} {:>10} {:>10} {:>10} {:>14}",
        name,
        fmt_ns(l.p50 as f64),
        fmt_ns(l.p99 as f64),
        fmt_ns(l.p999 as f64),
        fmt_ns(l.max as f64),
        fmt_ns(l.mean),
        fmt_rate(l.rate)
    );
}

fn lat_result(kind: &str, extra: &str, size: usize, l: &Latency) {
    println!(
        "RESULT rtt impl={kind}{extra} size={size} count={} p50_ns={} p99_ns={} p999_ns={} max_ns={} mean_ns={:.0} rtt_per_s={:.0}",
        l.count, l.p50, l.p99, l.p999, l.max, l.mean, l.rate
    );
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "MET"
    } else {
        "MISSED"
    }
}

/// Where the baseline's second party runs: as asked, else on the app core and on the (now
/// idle) poll core of a spawned rdsd, else anywhere.
fn baseline_peers(
    asked: &[i64],
    app_core: Option<usize>,
    target: &Target,
    poll_core: i64,
) -> Result<Vec<Option<usize>>> {
    let mut v: Vec<Option<usize>> = if asked.is_empty() {
        let mut d = vec![app_core];
        if target.is_spawned() {
            d.push(resolve_core(poll_core));
        }
        d.retain(|c| c.is_some());
        if d.is_empty() {
            d.push(None);
        }
        d
    } else {
        asked.iter().map(|&n| resolve_core(n)).collect()
    };
    v.dedup();
    for &c in &v {
        check_core("--peer-core", c)?;
    }
    Ok(v)
}

fn placement(app: Option<usize>, peer: Option<usize>) -> String {
    match (app, peer) {
        (Some(a), Some(p)) if a == p => format!("same CPU {a}"),
        (Some(a), Some(p)) => format!("CPUs {a}+{p}"),
        (a, p) => format!(
            "{}+{}",
            a.map_or("any".into(), |c| c.to_string()),
            p.map_or("any".into(), |c| c.to_string())
        ),
    }
}

fn mode_key(spin: bool) -> &'static str {
    if spin {
        "unix-spin"
    } else {
        "unix-block"
    }
}

fn cmd_rtt(a: RttArgs) -> Result<()> {
    check_size(a.size)?;
    check_core("--app-core", a.app_core)?;
    if a.count == 0 {
        bail!("--count must be at least 1");
    }
    let target = Target::open(&a.daemon)?;
    let peers = baseline_peers(&a.peer_core, a.app_core, &target, a.daemon.poll_core)?;
    let rdsd = target.attach()?;
    println!(
        "rds-bench rtt: {} B messages, {} round trips (+{} warm-up)",
        a.size, a.count, a.warmup
    );
    println!("  rdsd: {}", target.describe());
    println!(
        "  rdsd region on hugetlbfs pages: {}",
        if rdsd.uses_hugepages() { "yes" } else { "no" }
    );
    println!(
        "  app thread: {}; AF_UNIX echo process: {}",
        core_name(a.app_core),
        peers
            .iter()
            .map(|&c| core_name(c))
            .collect::<Vec<_>>()
            .join(", then ")
    );
    // Pure spinning only when the app thread surely has a core of its own; otherwise it may
    // share one with rdsd's poll thread and must let it run.
    let poll = if target.is_spawned() {
        resolve_core(a.daemon.poll_core)
    } else {
        None
    };
    let yield_every = match (a.app_core, poll) {
        (Some(c), Some(p)) if c != p => 0,
        _ => 64,
    };
    if yield_every > 0 {
        println!("  (app thread may share a CPU with rdsd's poll thread: it yields every 64 empty polls)");
    }
    let r = rds::rtt(&rdsd, a.count, a.warmup, a.size, a.app_core, yield_every)?;
    drop(rdsd);
    if target.is_spawned() {
        println!("  (rdsd stopped before the baseline runs)");
    } else {
        println!("  (external rdsd keeps running during the baseline: it may compete for CPU)");
    }
    target.stop()?;
    let mut base = Vec::new();
    for &spin in a.baseline.variants() {
        for &peer in &peers {
            base.push((
                spin,
                peer,
                unix::rtt(a.count, a.warmup, a.size, a.app_core, peer, spin)?,
            ));
        }
    }
    println!();
    lat_header();
    lat_row("rdsd loopback, 1 thread 2 sockets, busy-poll", &r);
    for (spin, peer, b) in &base {
        lat_row(
            &format!(
                "{} ({})",
                unix::label(*spin, "2 procs"),
                placement(a.app_core, *peer)
            ),
            b,
        );
    }
    println!();
    let mut best_block = None;
    for &spin in a.baseline.variants() {
        let Some((_, peer, b)) = base.iter().filter(|x| x.0 == spin).min_by_key(|x| x.2.p50) else {
            continue;
        };
        let ratio = b.p50 as f64 / r.p50.max(1) as f64;
        println!(
            "  ratio {} p50 / rdsd p50: {ratio:.2}x (fastest placement: {})",
            unix::label(spin, "2-process"),
            placement(a.app_core, *peer)
        );
        println!(
            "RESULT rtt_ratio baseline={} ratio_p50={ratio:.3} baseline_p50_ns={}",
            mode_key(spin),
            b.p50
        );
        if !spin {
            best_block = Some(ratio);
        }
    }
    println!(
        "  target rdsd p50 <= 2 µs: {} ({})",
        verdict(r.p50 <= TARGET_RTT_P50_NS),
        fmt_ns(r.p50 as f64)
    );
    if let Some(x) = best_block {
        println!(
            "  target >= 5x lower p50 than blocking AF_UNIX: {} ({x:.2}x)",
            verdict(x >= TARGET_RTT_RATIO)
        );
    }
    println!();
    lat_result("rdsd", "", a.size, &r);
    for (spin, peer, b) in &base {
        lat_result(
            mode_key(*spin),
            &format!(
                " placement={}",
                placement(a.app_core, *peer).replace(' ', "_")
            ),
            a.size,
            b,
        );
    }
    Ok(())
}

fn tput_row(name: &str, t: &Throughput) {
    println!(
        "  {:<58} {:>10} {:>10.1} {:>10} {:>12}",
        name,
        fmt_rate(t.msgs_per_s()),
        t.mb_per_s(),
        format!("{:.3} s", t.elapsed.as_secs_f64()),
        t.retries
    );
}

fn tput_result(kind: &str, extra: &str, t: &Throughput) {
    println!(
        "RESULT tput impl={kind}{extra} size={} count={} msgs_per_s={:.0} mb_per_s={:.1} secs={:.4} send_retries={}",
        t.size,
        t.count,
        t.msgs_per_s(),
        t.mb_per_s(),
        t.elapsed.as_secs_f64(),
        t.retries
    );
}

fn cmd_tput(a: TputArgs) -> Result<()> {
    check_size(a.size)?;
    check_core("--app-core", a.app_core)?;
    check_core("--receiver-core", a.receiver_core)?;
    let target = Target::open(&a.daemon)?;
    let peers = baseline_peers(&a.peer_core, a.app_core, &target, a.daemon.poll_core)?;
    let rdsd = target.attach()?;
    let rx_core = a.receiver_core.or(a.app_core);
    // Two busy threads sharing a core must take turns; on separate pinned cores they just spin.
    let yield_every = match (a.app_core, rx_core) {
        (Some(s), Some(r)) if s != r => 0,
        _ => 64,
    };
    println!(
        "rds-bench tput: {} messages of {} B, one way",
        a.count, a.size
    );
    println!("  rdsd: {}", target.describe());
    println!(
        "  rdsd region on hugetlbfs pages: {}",
        if rdsd.uses_hugepages() { "yes" } else { "no" }
    );
    println!(
        "  rdsd sender: {}, receiver: {}{}",
        core_name(a.app_core),
        core_name(rx_core),
        if yield_every > 0 {
            " (busy threads yield every 64 misses)"
        } else {
            ""
        }
    );
    println!(
        "  AF_UNIX sender: {}, receiver: {}",
        core_name(a.app_core),
        peers
            .iter()
            .map(|&c| core_name(c))
            .collect::<Vec<_>>()
            .join(", then ")
    );
    let r = rds::tput(&rdsd, a.count, a.size, a.app_core, rx_core, yield_every)?;
    drop(rdsd);
    target.stop()?;
    let mut base = Vec::new();
    for &spin in a.baseline.variants() {
        for &peer in &peers {
            let (t, sndbuf) = unix::tput(a.count, a.size, a.app_core, peer, spin)?;
            base.push((spin, peer, t, sndbuf));
        }
    }
    println!();
    println!(
        "  {:<58} {:>10} {:>10} {:>10} {:>12}",
        "", "msgs/s", "MB/s", "time", "send retries"
    );
    tput_row(
        &format!(
            "rdsd loopback, 2 threads, busy-poll ({})",
            placement(a.app_core, rx_core)
        ),
        &r,
    );
    for (spin, peer, t, _) in &base {
        tput_row(
            &format!(
                "{} ({})",
                unix::label(*spin, "2 threads"),
                placement(a.app_core, *peer)
            ),
            t,
        );
    }
    if let Some((_, _, _, sndbuf)) = base.first() {
        println!(
            "  (AF_UNIX SO_SNDBUF/SO_RCVBUF asked 16 MiB, got {} KiB)",
            sndbuf / 1024
        );
    }
    println!();
    for &spin in a.baseline.variants() {
        let Some((_, peer, t, _)) = base
            .iter()
            .filter(|x| x.0 == spin)
            .max_by(|x, y| x.2.msgs_per_s().total_cmp(&y.2.msgs_per_s()))
        else {
            continue;
        };
        let ratio = r.msgs_per_s() / t.msgs_per_s().max(1e-9);
        println!(
            "  ratio rdsd / {}: {ratio:.2}x (fastest placement: {})",
            unix::label(spin, "2-thread"),
            placement(a.app_core, *peer)
        );
        println!(
            "RESULT tput_ratio baseline={} ratio={ratio:.3} baseline_msgs_per_s={:.0}",
            mode_key(spin),
            t.msgs_per_s()
        );
    }
    println!(
        "  target >= 5 M msgs/s of 64 B: {} ({} msgs/s)",
        verdict(r.msgs_per_s() >= TARGET_TPUT),
        fmt_rate(r.msgs_per_s())
    );
    println!();
    tput_result("rdsd", "", &r);
    for (spin, peer, t, _) in &base {
        tput_result(
            mode_key(*spin),
            &format!(
                " placement={}",
                placement(a.app_core, *peer).replace(' ', "_")
            ),
            t,
        );
    }
    Ok(())
}

fn cmd_demo(a: DemoArgs) -> Result<()> {
    let t0 = Instant::now();
    let target = Target::open(&a.daemon)?;
    let rdsd = target.attach()?;
    println!("rds-bench demo: {}", target.describe());
    println!(
        "  shared region on hugetlbfs pages: {}",
        if rdsd.uses_hugepages() {
            "yes"
        } else {
            "no (4 KiB pages)"
        }
    );
    let before = rdsd.stats()?;

    println!(
        "[1/3] ping-pong: one thread, two sockets on 127.0.0.1, {} round trips of 64 B (busy-poll)",
        a.pings
    );
    // Unpinned, and rdsd's poll thread may be on the same CPU: yield now and then.
    let p = rds::rtt(&rdsd, a.pings, a.pings / 10, 64, None, 64)?;
    println!(
        "      RTT p50 {}  p99 {}  max {}  ({} round trips/s)",
        fmt_ns(p.p50 as f64),
        fmt_ns(p.p99 as f64),
        fmt_ns(p.max as f64),
        fmt_rate(p.rate)
    );

    println!(
        "[2/3] one-way burst: {} messages of 64 B from one thread to another",
        a.burst
    );
    let t = rds::tput(&rdsd, a.burst, 64, None, None, 64)?;
    println!(
        "      {} msgs/s, {:.1} MB/s ({} in {:.3} s, every message checked in order)",
        fmt_rate(t.msgs_per_s()),
        t.mb_per_s(),
        t.count,
        t.elapsed.as_secs_f64()
    );

    println!(
        "[3/3] two processes: {} round trips with an echo process, blocking sockets",
        a.exchanges
    );
    let x = rds::two_process_rtt(&rdsd, target.socket(), a.exchanges, 64)?;
    println!(
        "      RTT p50 {}  p99 {}  ({} round trips/s)",
        fmt_ns(x.p50 as f64),
        fmt_ns(x.p99 as f64),
        fmt_rate(x.rate)
    );

    let after = rdsd.stats()?;
    let delivered =
        counter(&after, "loop_delivered").saturating_sub(counter(&before, "loop_delivered"));
    let bytes = counter(&after, "loop_bytes").saturating_sub(counter(&before, "loop_bytes"));
    let full = counter(&after, "rx_ring_full").saturating_sub(counter(&before, "rx_ring_full"));
    drop(rdsd);
    println!();
    println!("summary:");
    println!("  ping-pong RTT p50        {}", fmt_ns(p.p50 as f64));
    println!(
        "  one-way 64 B             {} msgs/s",
        fmt_rate(t.msgs_per_s())
    );
    println!("  2-process blocking RTT   {}", fmt_ns(x.p50 as f64));
    println!("  rdsd delivered {delivered} messages ({:.1} MB) during the demo; receive ring full {full} times", bytes as f64 / 1e6);
    println!("  took {:.1} s", t0.elapsed().as_secs_f64());
    target.stop()?;
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Rtt(a) => cmd_rtt(a),
        Cmd::Tput(a) => cmd_tput(a),
        Cmd::Demo(a) => cmd_demo(a),
        Cmd::Blocking(a) => blocking::cmd(a),
        Cmd::RdsWake { socket } => blocking::wake_echo_main(&socket),
        Cmd::UnixEcho {
            fd,
            core,
            spin,
            yield_every,
        } => unix::echo_main(fd, core, spin, yield_every),
        Cmd::RdsEcho { socket } => rds::echo_main(&socket),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rds-bench: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

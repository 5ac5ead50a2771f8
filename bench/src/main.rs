//! `rds-bench`: an rds-stress-style load generator for rdsd, with kernel TCP, UDP and AF_UNIX
//! SOCK_SEQPACKET baselines run over the same workload in the same invocation (the default
//! mode, see `stress`), plus focused micro-benchmarks of rdsd's loopback path:
//!
//! ```text
//! rds-bench [-s PEER] [-r LOCAL] [-p PORT] [-t TASKS] [-d DEPTH] [-q REQ] [-a ACK] [-T SECS]
//!           [-o] [-z] [-v] [--show-histogram] [--json] [--out DIR] [--baselines] [--mode M] [--pair]
//! rds-bench rtt  [--socket PATH | --spawn-rdsd RDSD] [--count N] [--warmup N] [--size B] [--app-core C]
//! rds-bench tput [--socket PATH | --spawn-rdsd RDSD] [--count N] [--size B] [--app-core C]
//! rds-bench blocking [--socket PATH | --spawn-rdsd RDSD] [--count N] [--wake-samples N]
//! rds-bench fanout [--socket PATH | --spawn-rdsd RDSD] [--members 1,4,16,64] [--size B] [--messages N]
//! ```
//!
//! The default mode uses a running rdsd (`--socket`, `$RDSD_SOCKET` or the default control
//! socket); `--pair` or `--spawn-rdsd` start one (idle strategy backoff). The `rtt`, `tput` and
//! `blocking` micro-benchmarks start the `rdsd` next to their own executable unless given
//! `--socket` (`--idle spin --poll-core <--poll-core> --control-core -2 --hugepages auto`),
//! stop it *before* their AF_UNIX baseline runs, print a table, then `RESULT key=value ...`
//! lines for scripts.

mod blocking;
mod daemon;
mod fanout;
mod rds;
mod stress;
mod unix;
mod util;

use anyhow::{bail, Result};
use clap::{Parser, Subcommand};
use daemon::{DaemonArgs, Target};
use std::path::PathBuf;
use std::process::ExitCode;
use unix::Baseline;
use util::{check_core, fmt_ns, fmt_rate, resolve_core, Latency, Throughput};

/// Load generator and benchmarks for rdsd (userspace RDS).
///
/// Without a subcommand it works like rds-stress: with no -s it is the passive side, waits on
/// TCP port -p for one active side, serves it and exits; with -s PEER it is the active side, agrees on the parameters with the
/// passive side, runs each transport for -T seconds and prints a line per second, an
/// (average) line and round-trip percentiles; with --baselines the same workload runs over
/// kernel TCP, UDP and AF_UNIX SOCK_SEQPACKET too, and rdsd is shown against each as a ratio.
/// --pair runs both sides in this process tree against an rdsd of its own.
#[derive(Parser)]
#[command(version, args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    #[command(flatten)]
    stress: stress::StressArgs,
}

#[derive(Subcommand)]
enum Cmd {
    /// Round-trip latency: one thread ping-pongs between two rdsd sockets, busy-polling;
    /// then AF_UNIX SOCK_SEQPACKET ping-pong between two processes.
    Rtt(RttArgs),
    /// One-way throughput: a sender thread and a receiver thread, busy-polling; then the same
    /// over an AF_UNIX SOCK_SEQPACKET pair.
    Tput(TputArgs),
    /// Applications that sleep in recv: two-process blocking round trip next to AF_UNIX,
    /// wake-up latency after rdsd parked, idle CPU (rdsd on its default idle strategy).
    Blocking(blocking::BlockingArgs),
    /// Multicast fan-out: one sender, N member threads; an rdsd group next to N unicast rdsd
    /// sends, N AF_UNIX SOCK_SEQPACKET sends and iceoryx2 publish-subscribe, same run.
    Fanout(fanout::FanoutArgs),
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
    /// (internal) rdsd echo peer of `blocking`.
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
    /// Messages per send call: 1 sends one at a time; more uses `Socket::send_batch`
    /// (sendmmsg), which publishes each batch to rdsd at once, and the receiver takes up to
    /// as many per call with `Socket::recv_batch` (recvmmsg), releasing its ring once a call.
    #[arg(long, default_value_t = 1)]
    batch: usize,
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
    let r = rds::tput(
        &rdsd,
        a.count,
        a.size,
        a.app_core,
        rx_core,
        yield_every,
        a.batch,
    )?;
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    util::process_cpus();
    let Some(cmd) = cli.cmd else {
        return exit(stress::main(cli.stress));
    };
    let r = match cmd {
        Cmd::Rtt(a) => cmd_rtt(a),
        Cmd::Tput(a) => cmd_tput(a),
        Cmd::Blocking(a) => blocking::cmd(a),
        Cmd::Fanout(a) => fanout::cmd(a),
        Cmd::RdsWake { socket } => blocking::wake_echo_main(&socket),
        Cmd::UnixEcho {
            fd,
            core,
            spin,
            yield_every,
        } => unix::echo_main(fd, core, spin, yield_every),
        Cmd::RdsEcho { socket } => rds::echo_main(&socket),
    };
    exit(r)
}

fn exit(r: Result<()>) -> ExitCode {
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rds-bench: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

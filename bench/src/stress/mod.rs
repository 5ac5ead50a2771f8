//! rds-bench's default mode, in the manner of rds-stress: a passive side (no `-s`) waits on a
//! TCP control port; an active side (`-s PEER`) connects, both agree on the parameters, and
//! the active side drives one run per transport and mode (rdsd first, then the kernel
//! baselines over the same control connection), printing a line per second, an `(average)`
//! line and the round-trip percentiles, then rdsd against each baseline as a ratio.
//!
//! Control protocol (one text line each way per step):
//!
//! ```text
//! active:  HELLO 1 tasks=T depth=D req=Q ack=A oneway=0|1 verify=0|1
//! passive: OK                                   | ERR <why>
//! active:  RUN <rds|tcp|udp|unix> <busy|blocking>
//! passive: READY <addr> [<addr>...]             | ERR <why>
//!          (the active side connects and runs for -T seconds)
//! active:  STOP
//! passive: STATS <rx> <tx> <verify errors> [<first error>]
//! ...more RUNs...
//! active:  BYE
//! ```

pub mod chan;
mod plot;
mod report;
mod task;

use crate::daemon::{DaemonArgs, Target};
use anyhow::{bail, Context, Result};
use chan::Kind;
use report::{Line, RunResult};
use std::io::{BufRead, BufReader, IsTerminal, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use task::{Counters, Params, Shared, Snap, HDR};

/// Environment variable (passive side, tests only): corrupt one byte of every Nth ack.
pub const CORRUPT_ENV: &str = "RDS_BENCH_TEST_CORRUPT_EVERY";

const DEFAULT_TITLE: &str = "rds-bench";

/// Which app behaviour to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ModeSel {
    /// Apps busy-poll non-blocking sockets (yielding the CPU every --yield-every empty polls).
    Busy,
    /// Apps sleep in recv (rdsd: futex; kernel sockets: blocking calls).
    Blocking,
    /// Both, busy-poll first.
    Both,
}

/// rds-stress-style load (the default mode, when no subcommand is given).
#[derive(clap::Args, Debug, Clone)]
pub struct StressArgs {
    /// Local IPv4 address for the RDS and baseline sockets (passive: also where the control
    /// port listens). Default: the address the control connection uses.
    #[arg(short = 'r', long = "local", value_name = "ADDR")]
    pub local: Option<Ipv4Addr>,
    /// Local address for the RDS sockets only, when rdsd's address is not the kernel's (a
    /// DPDK port owns its address: the control connection and the baselines use `-r`'s).
    #[arg(long, value_name = "ADDR")]
    pub rds_addr: Option<Ipv4Addr>,
    /// Peer address: makes this the active side.
    #[arg(short = 's', long = "peer", value_name = "ADDR")]
    pub peer: Option<Ipv4Addr>,
    /// TCP control port (passive: 0 picks one and prints it).
    #[arg(short = 'p', long, default_value_t = 4000)]
    pub port: u16,
    /// Tasks (threads, one socket or connection each) on each side.
    #[arg(short = 't', long, default_value_t = 1)]
    pub tasks: u32,
    /// Requests in flight per task.
    #[arg(short = 'd', long, default_value_t = 1)]
    pub depth: u32,
    /// Request size in bytes (at least the 24-byte header).
    #[arg(short = 'q', long = "req-bytes", default_value_t = 1024)]
    pub req: usize,
    /// Ack size in bytes (at least the 24-byte header).
    #[arg(short = 'a', long = "ack-bytes", default_value_t = 64)]
    pub ack: usize,
    /// Seconds per run.
    #[arg(short = 'T', long = "time", default_value_t = 10)]
    pub secs: u64,
    /// One-way: requests only, no acks (no round trips to time).
    #[arg(short = 'o', long = "one-way")]
    pub one_way: bool,
    /// Summary only: no per-second lines.
    #[arg(short = 'z', long = "summary-only")]
    pub summary_only: bool,
    /// Verify every payload (a pattern derived from the sequence number); a corrupted message
    /// is reported and makes the exit status non-zero.
    #[arg(short = 'v', long = "verify")]
    pub verify: bool,
    /// Print the round-trip histogram.
    #[arg(long)]
    pub show_histogram: bool,
    /// Latency breakdown of rdsd's round trips, hop by hop: each request ends with a hop-trace
    /// block (`shm_api::hoptrace`) that the rdsd on each side stamps (they must run with
    /// `--trace-hops`; a spawned one does), and the ack echoes the request's stamps. Needs
    /// `-q >= 64` and `-a >= 96`; exact when both sides share one clock (one host).
    #[arg(long, conflicts_with = "verify")]
    pub breakdown: bool,
    /// Print the results as one JSON document on stdout (instead of text).
    #[arg(long)]
    pub json: bool,
    /// Write results.json, latency-cdf.svg, throughput.svg and summary.md into this folder.
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Transports to run, in order (rds = rdsd; tcp, udp, unix = kernel baselines).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "rds")]
    pub transports: Vec<Kind>,
    /// Add every kernel baseline (tcp, udp, unix) after the listed transports.
    #[arg(long)]
    pub baselines: bool,
    /// Busy-polling apps give the CPU away (sched_yield) every N empty polls; 0 = pure
    /// spinning, for machines with a core per busy thread (the app tasks of both sides and
    /// rdsd's poll thread).
    #[arg(long, default_value_t = 8, value_name = "N")]
    pub yield_every: u32,
    /// Busy-polling apps, apps that sleep in recv, or both.
    #[arg(long, value_enum, default_value_t = ModeSel::Busy)]
    pub mode: ModeSel,
    /// Each task attaches to rdsd on its own, an app of its own (as one MPI rank per process
    /// is), so that rdsd's poll threads share the tasks: rdsd gives each new app to the poll
    /// thread with the fewest. Default: one attachment (one app) per side, served by one poll
    /// thread. With --pair, both sides.
    #[arg(long)]
    pub attach_per_task: bool,
    /// Run both sides here: start a passive rds-bench on 127.0.0.1 (and, without --socket,
    /// an rdsd of our own), then drive it.
    #[arg(long, conflicts_with = "peer")]
    pub pair: bool,
    /// Plot title (default: the workload).
    #[arg(long, default_value = DEFAULT_TITLE)]
    pub title: String,
    /// (passive) print only the listening line.
    #[arg(long, hide = true)]
    pub quiet: bool,
    #[command(flatten)]
    pub daemon: DaemonArgs,
}

impl StressArgs {
    fn params(&self) -> Params {
        Params {
            tasks: self.tasks,
            depth: self.depth,
            req: self.req,
            ack: self.ack,
            one_way: self.one_way,
            verify: self.verify,
        }
    }

    fn runs(&self) -> Vec<(Kind, bool)> {
        let mut kinds = self.transports.clone();
        if self.baselines {
            kinds.extend([Kind::Tcp, Kind::Udp, Kind::Unix]);
        }
        let mut seen = Vec::new();
        kinds.retain(|k| {
            let new = !seen.contains(k);
            seen.push(*k);
            new
        });
        let modes: &[bool] = match self.mode {
            ModeSel::Busy => &[false],
            ModeSel::Blocking => &[true],
            ModeSel::Both => &[false, true],
        };
        modes
            .iter()
            .flat_map(|&b| kinds.iter().map(move |&k| (k, b)))
            .collect()
    }
}

/// Checks the parameters both sides must agree on.
fn validate(p: &Params) -> Result<()> {
    let max = shm_api::layout::MAX_MSG_SIZE;
    if p.tasks == 0 || p.tasks > 256 {
        bail!("-t {}: tasks must be between 1 and 256", p.tasks);
    }
    if p.depth == 0 || p.depth > 4096 {
        bail!("-d {}: depth must be between 1 and 4096", p.depth);
    }
    if p.req < HDR || p.req > max {
        bail!("-q {}: a request must be between {HDR} bytes (the header) and {max} bytes (RDS's 1 MiB limit)", p.req);
    }
    if p.ack < HDR || p.ack > max {
        bail!("-a {}: an ack must be between {HDR} bytes (the header) and {max} bytes (RDS's 1 MiB limit)", p.ack);
    }
    Ok(())
}

/// The rdsd to use: `--socket`, or one we start (`--spawn-rdsd`, or `--pair` without
/// `--socket`; idle strategy backoff unless `--idle` says otherwise), or else
/// `$RDSD_SOCKET` / the default control socket.
fn target(d: &DaemonArgs, pair: bool, trace_hops: bool) -> Result<Target> {
    if d.socket.is_some() || d.spawn_rdsd.is_some() || pair {
        let mut d = d.clone();
        d.trace_hops = trace_hops;
        d.idle.get_or_insert_with(|| "backoff".into());
        return Target::open(&d);
    }
    Ok(Target::External(
        std::env::var_os("RDSD_SOCKET")
            .map(PathBuf::from)
            .unwrap_or_else(|| shm_api::DEFAULT_CONTROL_SOCKET.into()),
    ))
}

pub fn main(a: StressArgs) -> Result<()> {
    let p = a.params();
    validate(&p)?;
    if a.secs == 0 {
        bail!("-T 0: a run lasts at least 1 second");
    }
    for (k, _) in a.runs() {
        if p.req.max(p.ack) > k.max_msg() {
            bail!(
                "--transports {}: messages of {} bytes do not fit in one {} datagram (at most {})",
                k.key(),
                p.req.max(p.ack),
                k.label(),
                k.max_msg()
            );
        }
    }
    if a.pair {
        pair(&a)
    } else if a.peer.is_some() {
        let t = target(&a.daemon, false, a.breakdown)?;
        let r = active(&a, &t, a.port);
        t.stop()?;
        r
    } else {
        let t = target(&a.daemon, false, a.breakdown)?;
        let r = passive(&a, &t);
        t.stop()?;
        r
    }
}

// ---- control connection ---------------------------------------------------------------------

struct Ctl {
    r: BufReader<TcpStream>,
    w: TcpStream,
}

impl Ctl {
    fn new(s: TcpStream) -> Result<Ctl> {
        s.set_nodelay(true)?;
        Ok(Ctl {
            r: BufReader::new(s.try_clone()?),
            w: s,
        })
    }

    fn send(&mut self, line: &str) -> Result<()> {
        self.w
            .write_all(format!("{line}\n").as_bytes())
            .context("control connection")
    }

    fn recv(&mut self) -> Result<String> {
        let mut l = String::new();
        if self.r.read_line(&mut l).context("control connection")? == 0 {
            bail!("the other side closed the control connection");
        }
        Ok(l.trim_end().to_string())
    }
}

fn kv(words: &[&str], key: &str) -> Result<u64> {
    words
        .iter()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("missing {key}= in the HELLO line"))
}

/// One attachment for the side, or (`--attach-per-task`) one per task; either way, a side
/// that cannot attach fails here, with a clear error.
fn attach(a: &StressArgs, t: &Target) -> Result<chan::Attach> {
    let rdsd = t.attach()?;
    Ok(if a.attach_per_task {
        chan::Attach::PerTask(t.socket().to_path_buf())
    } else {
        chan::Attach::Shared(rdsd)
    })
}

// ---- passive side ---------------------------------------------------------------------------

fn passive(a: &StressArgs, t: &Target) -> Result<()> {
    let rdsd = attach(a, t)?;
    let bind = SocketAddrV4::new(a.local.unwrap_or(Ipv4Addr::UNSPECIFIED), a.port);
    let l = TcpListener::bind(bind).with_context(|| format!("cannot listen on {bind}"))?;
    println!("rds-bench passive: listening on {}", l.local_addr()?);
    std::io::stdout().flush()?;
    let (s, from) = l.accept().context("accept")?;
    drop(l);
    let local = match a.local {
        Some(ip) => ip,
        None => match s.local_addr()? {
            std::net::SocketAddr::V4(v) => *v.ip(),
            _ => bail!("the control connection is not IPv4"),
        },
    };
    let mut ctl = Ctl::new(s)?;
    let hello = ctl.recv()?;
    let w: Vec<&str> = hello.split_whitespace().collect();
    if w.first() != Some(&"HELLO") || w.get(1) != Some(&"1") {
        ctl.send("ERR expected HELLO 1")?;
        bail!("{from} said {hello:?} instead of HELLO 1");
    }
    let p = Params {
        tasks: kv(&w, "tasks")? as u32,
        depth: kv(&w, "depth")? as u32,
        req: kv(&w, "req")? as usize,
        ack: kv(&w, "ack")? as usize,
        one_way: kv(&w, "oneway")? != 0,
        verify: kv(&w, "verify")? != 0,
    };
    if let Err(e) = validate(&p) {
        ctl.send(&format!("ERR {e}"))?;
        return Err(e);
    }
    ctl.send("OK")?;
    let corrupt_every = std::env::var(CORRUPT_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    loop {
        let line = match ctl.recv() {
            Ok(l) => l,
            Err(_) => break,
        };
        let w: Vec<&str> = line.split_whitespace().collect();
        match w.as_slice() {
            ["BYE"] => break,
            ["RUN", kind, mode] => {
                let (Some(kind), blocking) = (Kind::from_key(kind), *mode == "blocking") else {
                    ctl.send("ERR unknown transport")?;
                    continue;
                };
                let bind = if kind == Kind::Rds {
                    a.rds_addr.unwrap_or(local)
                } else {
                    local
                };
                let lis = match chan::listen(kind, Some(&rdsd), bind, p.tasks, blocking) {
                    Ok(l) => l,
                    Err(e) => {
                        ctl.send(&format!("ERR {e:#}"))?;
                        continue;
                    }
                };
                ctl.send(&format!("READY {}", lis.addrs()?.join(" ")))?;
                let stats = passive_run(
                    &mut ctl,
                    lis,
                    p,
                    kind,
                    blocking,
                    corrupt_every,
                    a.yield_every,
                )?;
                if !a.quiet {
                    println!(
                        "rds-bench passive: {} ({}): {} requests, {} acks, {} verify errors",
                        kind.label(),
                        report::mode_name(blocking),
                        stats.0.rx,
                        stats.0.tx,
                        stats.0.verify_errors
                    );
                }
                let err = stats.1.unwrap_or_default().replace('\n', " ");
                ctl.send(&format!(
                    "STATS {} {} {} {err}",
                    stats.0.rx, stats.0.tx, stats.0.verify_errors
                ))?;
            }
            _ => {
                ctl.send(&format!("ERR unexpected {line:?}"))?;
            }
        }
    }
    Ok(())
}

/// Serves one run until STOP: returns the counters and the first error or verify failure.
fn passive_run(
    ctl: &mut Ctl,
    lis: chan::Listening,
    p: Params,
    kind: Kind,
    blocking: bool,
    corrupt_every: u64,
    yield_every: u32,
) -> Result<(Snap, Option<String>)> {
    let chans = match lis.into_chans(p.tasks, blocking) {
        Ok(c) => c,
        Err(e) => {
            // Wait for the STOP that follows the active side's failure.
            let _ = ctl.recv();
            return Ok((Snap::default(), Some(format!("{e:#}"))));
        }
    };
    let ctrs: Vec<Counters> = (0..p.tasks).map(|_| Counters::default()).collect();
    let stop = AtomicBool::new(false);
    let errors = Mutex::new(Vec::new());
    let sh = Shared {
        p,
        stop: &stop,
        errors: &errors,
        reliable: kind.reliable(),
        corrupt_every,
        blocking,
        yield_every,
        hops: None,
    };
    let results: Vec<Result<()>> = std::thread::scope(|s| {
        let hs: Vec<_> = chans
            .into_iter()
            .zip(&ctrs)
            .map(|(mut ch, ctr)| {
                let sh = &sh;
                s.spawn(move || task::passive(ch.as_mut(), sh, ctr))
            })
            .collect();
        let r = ctl.recv();
        stop.store(true, Ordering::Relaxed);
        let out = hs
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("task panicked")))
            })
            .collect();
        if let Ok(l) = r {
            if l != "STOP" {
                eprintln!("rds-bench passive: expected STOP, got {l:?}");
            }
        }
        out
    });
    let first = results
        .into_iter()
        .find_map(|r| r.err().map(|e| format!("{e:#}")))
        .or_else(|| errors.lock().ok()?.first().cloned());
    Ok((Snap::sum(&ctrs), first))
}

// ---- active side ----------------------------------------------------------------------------

fn connect_ctl(peer: SocketAddrV4) -> Result<TcpStream> {
    let start = Instant::now();
    loop {
        match TcpStream::connect_timeout(&peer.into(), Duration::from_secs(2)) {
            Ok(s) => return Ok(s),
            Err(e) if start.elapsed() < Duration::from_secs(5) => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => {
                return Err(e).with_context(|| {
                    format!(
                    "cannot reach a passive rds-bench at {peer} (start one there: rds-bench -p {})",
                    peer.port()
                )
                })
            }
        }
    }
}

/// Progress on stderr, only when it is a terminal and stdout does not already show lines.
struct Progress {
    on: bool,
}

impl Progress {
    fn show(&self, what: &str, sec: u64, total: u64) {
        if self.on {
            let n = 30 * sec / total.max(1);
            eprint!(
                "\r  [{}{}] {sec}/{total} s {what}\x1b[K",
                "=".repeat(n as usize),
                " ".repeat(30 - n as usize)
            );
        }
    }

    fn done(&self) {
        if self.on {
            eprint!("\r\x1b[K");
        }
    }
}

fn active(a: &StressArgs, t: &Target, port: u16) -> Result<()> {
    let p = a.params();
    let runs = a.runs();
    if runs.is_empty() {
        bail!("--transports: nothing to run");
    }
    if a.breakdown && (p.req < task::TRACED_REQ || p.ack < task::TRACED_ACK) {
        bail!(
            "--breakdown needs -q >= {} (header and trace block) and -a >= {} (the ack also \
             echoes the request's stamps)",
            task::TRACED_REQ,
            task::TRACED_ACK
        );
    }
    let rdsd = if runs.iter().any(|r| r.0 == Kind::Rds) {
        Some(attach(a, t)?)
    } else {
        None
    };
    let peer_ip = a.peer.unwrap_or(Ipv4Addr::LOCALHOST);
    let peer = SocketAddrV4::new(peer_ip, port);
    let s = connect_ctl(peer)?;
    let local = match (a.local, s.local_addr()?) {
        (Some(ip), _) => ip,
        (None, std::net::SocketAddr::V4(v)) => *v.ip(),
        _ => bail!("the control connection is not IPv4"),
    };
    let mut ctl = Ctl::new(s)?;
    ctl.send(&format!(
        "HELLO 1 tasks={} depth={} req={} ack={} oneway={} verify={}",
        p.tasks, p.depth, p.req, p.ack, p.one_way as u8, p.verify as u8
    ))?;
    let r = ctl.recv()?;
    if r != "OK" {
        bail!(
            "the passive side refused the parameters: {}",
            r.strip_prefix("ERR ").unwrap_or(&r)
        );
    }
    let text = !a.json;
    let lines = text && !a.summary_only;
    let progress = Progress {
        on: std::io::stderr().is_terminal() && !(lines && std::io::stdout().is_terminal()),
    };
    let route = format!("{local} -> {peer_ip}");
    let mut results = Vec::new();
    for &(kind, blocking) in &runs {
        if text {
            println!("{}", report::run_title(kind, blocking, &p, a.secs, &route));
        }
        let bind = if kind == Kind::Rds {
            a.rds_addr.unwrap_or(local)
        } else {
            local
        };
        let r = active_run(
            &mut ctl,
            rdsd.as_ref(),
            bind,
            p,
            kind,
            blocking,
            a.secs,
            a.yield_every,
            lines,
            &progress,
            a.breakdown && kind == Kind::Rds,
        )?;
        if text {
            print!("{}", report::summary(&r, a.show_histogram));
            println!();
        }
        results.push(r);
    }
    ctl.send("BYE")?;
    drop(rdsd);

    let title = if a.title == DEFAULT_TITLE {
        format!(
            "{}: {} task(s), depth {}, {} B req / {} B ack{}",
            a.title,
            p.tasks,
            p.depth,
            p.req,
            p.ack,
            if p.one_way { ", one-way" } else { "" }
        )
    } else {
        a.title.clone()
    };
    let mut plots = None;
    if let Some(dir) = &a.out {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let cdf = dir.join("latency-cdf.svg");
        let tput = dir.join("throughput.svg");
        plot::latency_cdf(&cdf, &format!("{title}: round-trip CDF"), &results)?;
        plot::throughput(&tput, &format!("{title}: messages per second"), &results)?;
        plots = Some((cdf.display().to_string(), tput.display().to_string()));
        std::fs::write(
            dir.join("summary.md"),
            format!(
                "{}\n\n![round-trip CDF](latency-cdf.svg)\n![messages per second](throughput.svg)\n",
                report::markdown(&results)
            ),
        )?;
    }
    let doc = report::document(
        &p,
        a.secs,
        &local.to_string(),
        &peer.to_string(),
        &results,
        plots.as_ref().map(|(a, b)| (a.as_str(), b.as_str())),
    );
    let json = serde_json::to_string_pretty(&doc)?;
    if let Some(dir) = &a.out {
        std::fs::write(dir.join("results.json"), &json)?;
    }
    if a.json {
        println!("{json}");
    } else {
        if results.len() > 1 {
            print!("{}", report::comparison(&results));
        }
        if let (Some(dir), Some((cdf, tput))) = (&a.out, &plots) {
            println!(
                "results: {}  plots: {cdf} {tput}",
                dir.join("results.json").display()
            );
        }
    }
    let bad: u64 = results.iter().map(RunResult::total_verify_errors).sum();
    if bad > 0 {
        let first = results
            .iter()
            .flat_map(|r| r.errors.iter().chain(r.passive_error.iter()))
            .next()
            .cloned()
            .unwrap_or_default();
        bail!("payload verification failed: {bad} corrupted messages (first: {first})");
    }
    if let Some(r) = results.iter().find(|r| r.kind.reliable() && r.lost > 0) {
        bail!(
            "{}: {} messages lost on a reliable transport",
            r.label(),
            r.lost
        );
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn active_run(
    ctl: &mut Ctl,
    rdsd: Option<&chan::Attach>,
    local: Ipv4Addr,
    p: Params,
    kind: Kind,
    blocking: bool,
    secs: u64,
    yield_every: u32,
    lines: bool,
    progress: &Progress,
    breakdown: bool,
) -> Result<RunResult> {
    ctl.send(&format!(
        "RUN {} {}",
        kind.key(),
        if blocking { "blocking" } else { "busy" }
    ))?;
    let r = ctl.recv()?;
    let addrs: Vec<String> = match r.strip_prefix("READY ") {
        Some(a) => a.split_whitespace().map(String::from).collect(),
        None => bail!(
            "{}: the passive side could not set up: {}",
            kind.label(),
            r.strip_prefix("ERR ").unwrap_or(&r)
        ),
    };
    let chans = match chan::connect(kind, rdsd, local, &addrs, p.tasks, blocking) {
        Ok(c) => c,
        Err(e) => {
            let _ = ctl.send("STOP");
            let _ = ctl.recv();
            return Err(e.context(format!("{}: cannot connect", kind.label())));
        }
    };
    let ctrs: Vec<Counters> = (0..p.tasks).map(|_| Counters::default()).collect();
    let stop = AtomicBool::new(false);
    let go = AtomicBool::new(false);
    let ready = AtomicU32::new(0);
    let errors = Mutex::new(Vec::new());
    let hops = Mutex::new(task::Breakdown::new());
    let sh = Shared {
        p,
        stop: &stop,
        errors: &errors,
        reliable: kind.reliable(),
        corrupt_every: 0,
        blocking,
        yield_every,
        hops: breakdown.then_some(&hops),
    };
    let mut per_sec = Vec::new();
    let mut elapsed = Duration::ZERO;
    let mut cpu_total = 0.0;
    type TaskOut = Result<hdrhistogram::Histogram<u64>>;
    let outs: Vec<TaskOut> = std::thread::scope(|s| {
        let hs: Vec<_> = chans
            .into_iter()
            .zip(&ctrs)
            .enumerate()
            .map(|(i, (mut ch, ctr))| {
                let (sh, go, ready) = (&sh, &go, &ready);
                s.spawn(move || -> TaskOut {
                    let mut hist = crate::util::new_histogram();
                    let start = || {
                        ready.fetch_add(1, Ordering::SeqCst);
                        while !go.load(Ordering::Acquire) {
                            std::thread::sleep(Duration::from_micros(100));
                        }
                    };
                    let r = task::active(ch.as_mut(), sh, i as u32, ctr, &mut hist, &start);
                    if r.is_err() {
                        sh.stop.store(true, Ordering::Relaxed);
                        // Let the others go (and stop) if they are still waiting.
                        ready.fetch_add(1 << 16, Ordering::SeqCst);
                    }
                    r.map(|()| hist)
                })
            })
            .collect();
        while ready.load(Ordering::SeqCst) < p.tasks {
            std::thread::sleep(Duration::from_millis(1));
        }
        let t0 = Instant::now();
        let mut prev = Snap::sum(&ctrs);
        let mut prev_cpu = report::cpu_sample();
        let cpu0 = prev_cpu;
        go.store(true, Ordering::Release);
        let mut tprev = t0;
        for sec in 1..=secs {
            if stop.load(Ordering::Relaxed) {
                break;
            }
            let due = t0 + Duration::from_secs(sec);
            while let Some(d) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(d.min(Duration::from_millis(50)));
                if stop.load(Ordering::Relaxed) {
                    break;
                }
            }
            let now = Instant::now();
            let snap = Snap::sum(&ctrs);
            let cpu = report::cpu_sample();
            let l = Line::from(
                &snap.minus(&prev),
                p.tasks,
                now - tprev,
                report::cpu_pct(prev_cpu, cpu),
            );
            if lines {
                if sec == 1 {
                    println!("{}", report::HEADER);
                }
                println!("{}", report::line(&l, ""));
            }
            progress.show(
                &format!("{} ({})", kind.label(), report::mode_name(blocking)),
                sec,
                secs,
            );
            per_sec.push(l);
            prev = snap;
            prev_cpu = cpu;
            tprev = now;
        }
        stop.store(true, Ordering::Relaxed);
        elapsed = tprev - t0;
        cpu_total = report::cpu_pct(cpu0, prev_cpu);
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("task panicked")))
            })
            .collect()
    });
    progress.done();
    ctl.send("STOP")?;
    let st = ctl.recv()?;
    let w: Vec<&str> = st.splitn(5, ' ').collect();
    if w.first() != Some(&"STATS") || w.len() < 4 {
        bail!("the passive side answered {st:?} to STOP");
    }
    let num = |i: usize| w[i].parse::<u64>().unwrap_or(0);
    let passive_error = w
        .get(4)
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty());
    let mut hist = crate::util::new_histogram();
    for o in outs {
        hist.add(o.with_context(|| kind.label())?)
            .map_err(|e| anyhow::anyhow!("histogram: {e:?}"))?;
    }
    let total = Snap::sum(&ctrs);
    let avg = Line::from(&total, p.tasks, elapsed, cpu_total);
    let errors = errors.into_inner().unwrap_or_default();
    let breakdown = breakdown.then(|| hops.into_inner().unwrap_or_else(|p| p.into_inner()));
    Ok(RunResult {
        kind,
        blocking,
        p,
        secs: elapsed.as_secs_f64(),
        per_sec,
        avg,
        hist,
        verify_errors: total.verify_errors,
        lost: total.lost,
        sent: total.tx,
        errors,
        passive_rx: num(1),
        passive_tx: num(2),
        passive_verify_errors: num(3),
        passive_error,
        breakdown,
    })
}

// ---- both sides here ------------------------------------------------------------------------

struct PassiveChild(Option<Child>);

impl Drop for PassiveChild {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn pair(a: &StressArgs) -> Result<()> {
    let t = target(&a.daemon, true, a.breakdown)?;
    // A clear error here rather than from the passive child.
    drop(t.attach()?);
    let mut child = Command::new(std::env::current_exe()?)
        .args(["-p", "0", "-r", "127.0.0.1", "--quiet", "--yield-every"])
        .arg(a.yield_every.to_string())
        .args(a.attach_per_task.then_some("--attach-per-task"))
        .arg("--socket")
        .arg(t.socket())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .context("cannot start the passive rds-bench")?;
    let out = child.stdout.take().expect("piped");
    let mut guard = PassiveChild(Some(child));
    let mut rd = BufReader::new(out);
    let mut first = String::new();
    rd.read_line(&mut first)?;
    let port: u16 = first
        .trim()
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .with_context(|| {
            format!("the passive rds-bench did not start (it said {first:?}; see its error above)")
        })?;
    // Keep its stdout drained.
    std::thread::spawn(move || {
        let mut sink = Vec::new();
        let _ = std::io::Read::read_to_end(&mut rd, &mut sink);
    });
    let mut act = a.clone();
    act.peer = Some(Ipv4Addr::LOCALHOST);
    act.local = Some(Ipv4Addr::LOCALHOST);
    let r = active(&act, &t, port);
    if let Some(mut c) = guard.0.take() {
        if r.is_err() {
            let _ = c.kill();
        }
        let st = c.wait()?;
        if r.is_ok() && !st.success() {
            bail!("the passive rds-bench exited with {st}");
        }
    }
    t.stop()?;
    r
}

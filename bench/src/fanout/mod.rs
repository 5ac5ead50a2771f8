//! `rds-bench fanout`: one sender, N member receivers (threads of this process, each with its
//! own socket, blocking receives), one 64 B message fanned out to all of them, over
//!
//! - an rdsd multicast group: one `send_to(group)` per message (rdsd's poll thread copies it
//!   into every member's ring, all or none);
//! - N unicast rdsd sends: one `send_to(member)` per member per message;
//! - N AF_UNIX SOCK_SEQPACKET sends: one `send(2)` per member per message;
//! - iceoryx2 publish-subscribe (the crate, as a peer): one publish plus one event
//!   notification that wakes the subscribers' listeners (iceoryx2's subscribers have no
//!   blocking receive of their own).
//!
//! For each N it measures (a) the latency from the send until the LAST member has the message,
//! one message in flight (the last member stamps CLOCK_MONOTONIC and unparks the sender), and
//! (b) messages/s with at most `--window` messages not yet at every member, plus the sender's
//! time inside its send calls per fanned-out message. Every member checks every sequence
//! number (nothing lost, duplicated or reordered) and the run fails otherwise.

mod iceoryx2_peer;

use crate::daemon::{counter, DaemonArgs, Target};
use crate::rds::bound_socket;
use crate::unix;
use crate::util::{fmt_ns, fmt_rate, mono_ns, new_histogram, stamp};
use anyhow::{bail, Context, Result};
use hdrhistogram::Histogram;
use shm_api::{GroupFlags, Rdsd, Socket};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Barrier;
use std::thread::Thread;
use std::time::{Duration, Instant};

/// Arguments of `rds-bench fanout`.
#[derive(clap::Args)]
pub struct FanoutArgs {
    #[command(flatten)]
    pub daemon: DaemonArgs,
    /// Group sizes to measure (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64")]
    pub members: Vec<usize>,
    /// Message size in bytes (at least 8: the sequence number).
    #[arg(long, default_value_t = 64)]
    pub size: usize,
    /// Messages of the throughput phase, per implementation and group size.
    #[arg(long, default_value_t = 20_000)]
    pub messages: u64,
    /// Messages of the latency phase (one in flight), after --warmup more.
    #[arg(long, default_value_t = 2_000)]
    pub latency_count: u64,
    /// Unmeasured one-in-flight messages before the latency phase.
    #[arg(long, default_value_t = 200)]
    pub warmup: u64,
    /// Throughput phase: at most this many messages not yet received by every member.
    #[arg(long, default_value_t = 64)]
    pub window: u64,
    /// Rounds over all group sizes and implementations; each row merges its rounds (latency
    /// histograms added, the median round's msgs/s and sender time).
    #[arg(long, default_value_t = 1)]
    pub repeat: u32,
    /// The spawned rdsd, whose CPU time per message is shown.
    #[arg(skip)]
    pub rdsd_pid: Option<u32>,
    /// Implementations to run (comma-separated: group, rds, unix, iceoryx2).
    #[arg(long, value_delimiter = ',', default_value = "group,rds,unix,iceoryx2")]
    pub impls: Vec<Impl>,
}

/// What carries the fan-out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Impl {
    /// rdsd multicast group, one send_to(group).
    Group,
    /// rdsd unicast, one send_to per member.
    Rds,
    /// AF_UNIX SOCK_SEQPACKET, one send per member.
    Unix,
    /// iceoryx2 publish-subscribe plus an event to wake the subscribers.
    Iceoryx2,
}

impl Impl {
    fn key(self) -> &'static str {
        match self {
            Impl::Group => "group",
            Impl::Rds => "rds-unicast",
            Impl::Unix => "unix-seqpacket",
            Impl::Iceoryx2 => "iceoryx2",
        }
    }

    fn label(self, n: usize) -> String {
        match self {
            Impl::Group => "rdsd group, 1 send_to(group)".into(),
            Impl::Rds => format!("rdsd unicast, {n} send_to"),
            Impl::Unix => format!("AF_UNIX seqpacket, {n} send"),
            Impl::Iceoryx2 => "iceoryx2 pub-sub + event notify".into(),
        }
    }
}

/// Figures of one implementation at one group size.
pub struct FanoutResult {
    pub imp: Impl,
    pub members: usize,
    /// Send until the last member has it, one in flight.
    pub last_member: Histogram<u64>,
    /// The sender's time inside its send call(s) per message, one in flight.
    pub send_call: Histogram<u64>,
    /// Throughput phase: messages (each to every member) per second.
    pub msgs_per_s: f64,
    /// Throughput phase: the sender's mean time inside its send calls per message.
    pub send_ns_mean: f64,
    /// Throughput phase: rdsd's CPU time (all its threads) per message, if we know its pid.
    pub rdsd_cpu_ns: Option<f64>,
    /// Throughput phase: this process's CPU time (sender and members) per message.
    pub app_cpu_ns: f64,
    /// Messages received by all members together (checked against the expected count).
    pub delivered: u64,
    pub expected: u64,
}

impl FanoutResult {
    fn clone_figures(&self) -> FanoutResult {
        FanoutResult {
            imp: self.imp,
            members: self.members,
            last_member: self.last_member.clone(),
            send_call: self.send_call.clone(),
            msgs_per_s: self.msgs_per_s,
            send_ns_mean: self.send_ns_mean,
            rdsd_cpu_ns: self.rdsd_cpu_ns,
            app_cpu_ns: self.app_cpu_ns,
            delivered: self.delivered,
            expected: self.expected,
        }
    }
}

/// One row out of several rounds: latencies over all of them, the median round's throughput
/// and sender time, all deliveries.
fn merge(mut rounds: Vec<FanoutResult>) -> FanoutResult {
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let mut tput: Vec<f64> = rounds.iter().map(|r| r.msgs_per_s).collect();
    let mut send: Vec<f64> = rounds.iter().map(|r| r.send_ns_mean).collect();
    let mut app: Vec<f64> = rounds.iter().map(|r| r.app_cpu_ns).collect();
    let mut daemon: Vec<f64> = rounds.iter().filter_map(|r| r.rdsd_cpu_ns).collect();
    let mut out = rounds.remove(0);
    for r in &rounds {
        out.last_member.add(&r.last_member).expect("same bounds");
        out.send_call.add(&r.send_call).expect("same bounds");
        out.delivered += r.delivered;
        out.expected += r.expected;
    }
    out.msgs_per_s = median(&mut tput);
    out.send_ns_mean = median(&mut send);
    out.app_cpu_ns = median(&mut app);
    out.rdsd_cpu_ns = (!daemon.is_empty()).then(|| median(&mut daemon));
    out
}

/// What the member threads and the sender share.
struct Shared {
    members: usize,
    /// Messages before the throughput phase (one in flight).
    one_in_flight: u64,
    total: u64,
    /// Receptions, all members together (one in flight: N per message).
    acks: AtomicU64,
    /// Messages of the one-in-flight phases that every member has.
    rounds_done: AtomicU64,
    /// CLOCK_MONOTONIC when the last member got the latest one-in-flight message.
    last_ns: AtomicU64,
    /// Per member: messages received so far.
    received: Vec<crossbeam_utils::CachePadded<AtomicU64>>,
    /// Throughput phase: the sender sleeps until every member has this many (u64::MAX: awake).
    wait_for: AtomicU64,
    /// Throughput phase: when the last member got the last message (complete once every
    /// member's count is `total`).
    finished_ns: AtomicU64,
    failed: AtomicBool,
    sender: Thread,
}

impl Shared {
    fn new(members: usize, one_in_flight: u64, total: u64) -> Shared {
        Shared {
            members,
            one_in_flight,
            total,
            acks: AtomicU64::new(0),
            rounds_done: AtomicU64::new(0),
            last_ns: AtomicU64::new(0),
            received: (0..members)
                .map(|_| crossbeam_utils::CachePadded::new(AtomicU64::new(0)))
                .collect(),
            wait_for: AtomicU64::new(u64::MAX),
            finished_ns: AtomicU64::new(0),
            failed: AtomicBool::new(false),
            sender: std::thread::current(),
        }
    }

    /// Member `m` got message `seq` (its `seq`-th, checked by the caller) at `now`.
    fn got(&self, m: usize, seq: u64, now: u64) {
        if seq + 1 == self.total {
            // Before the count: once every count says done, the latest time is in.
            self.finished_ns.fetch_max(now, Ordering::SeqCst);
        }
        self.received[m].store(seq + 1, Ordering::SeqCst);
        if seq < self.one_in_flight {
            let before = self.acks.fetch_add(1, Ordering::SeqCst);
            if before + 1 == self.members as u64 * (seq + 1) {
                self.last_ns.store(now, Ordering::SeqCst);
                self.rounds_done.store(seq + 1, Ordering::SeqCst);
                self.sender.unpark();
            }
            return;
        }
        if seq + 1 >= self.wait_for.load(Ordering::SeqCst) {
            self.sender.unpark();
        }
    }

    fn fail(&self) {
        self.failed.store(true, Ordering::SeqCst);
        self.sender.unpark();
    }

    fn min_received(&self) -> u64 {
        self.received
            .iter()
            .map(|r| r.load(Ordering::SeqCst))
            .min()
            .unwrap_or(0)
    }

    /// Sleeps until `cond` holds; fails if a member failed or nothing happens for 10 s.
    fn wait(&self, cond: impl Fn() -> bool) -> Result<()> {
        let start = Instant::now();
        while !cond() {
            if self.failed.load(Ordering::SeqCst) {
                bail!("a member failed");
            }
            if start.elapsed() > Duration::from_secs(10) {
                bail!("members made no progress for 10 s");
            }
            std::thread::park_timeout(Duration::from_millis(100));
        }
        Ok(())
    }

    /// Waits until at most `window` messages of the first `sent` are missing at some member.
    fn wait_window(&self, sent: u64, window: u64, min_seen: &mut u64) -> Result<()> {
        if sent < *min_seen + window {
            return Ok(());
        }
        *min_seen = self.min_received();
        if sent < *min_seen + window {
            return Ok(());
        }
        let need = sent + 1 - window;
        self.wait_for.store(need, Ordering::SeqCst);
        let r = self.wait(|| self.min_received() >= need);
        self.wait_for.store(u64::MAX, Ordering::SeqCst);
        *min_seen = self.min_received();
        r
    }
}

/// CPU time of every thread of process `pid` so far, in ns (schedstat: nanosecond clock,
/// unlike the 10 ms ticks of /proc/PID/stat).
fn process_cpu_ns(pid: u32) -> Option<u64> {
    let mut sum = 0;
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let stat = std::fs::read_to_string(t.ok()?.path().join("schedstat")).ok()?;
        sum += stat.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(sum)
}

/// CPU time of this process so far, in ns (getrusage counts threads that have exited too).
fn own_cpu_ns() -> u64 {
    // SAFETY: getrusage writes one rusage into the zeroed struct we pass.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut ru);
        ru
    };
    let us = |t: libc::timeval| t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64;
    (us(ru.ru_utime) + us(ru.ru_stime)) * 1_000
}

/// The receive loop of member `m`: `recv` fills the buffer and returns the length.
fn member_loop(
    sh: &Shared,
    m: usize,
    size: usize,
    mut recv: impl FnMut(&mut [u8]) -> Result<usize>,
) -> Result<u64> {
    let r = (|| -> Result<u64> {
        let mut buf = vec![0u8; size + 64];
        for seq in 0..sh.total {
            let n = recv(&mut buf).with_context(|| format!("member {m}, message {seq}"))?;
            let now = mono_ns();
            if n != size {
                bail!("member {m}, message {seq}: {n} bytes, expected {size}");
            }
            let got = u64::from_le_bytes(buf[..8].try_into().expect("8 bytes"));
            if got != seq {
                bail!(
                    "member {m}: expected message {seq}, got {got} (lost, duplicated or reordered)"
                );
            }
            sh.got(m, seq, now);
        }
        Ok(sh.total)
    })();
    if r.is_err() {
        sh.fail();
    }
    r
}

/// The sender's side: warm-up and latency phase one in flight, then the throughput phase.
/// `send` fans one message out (and returns when its send calls did).
fn sender_loop(
    sh: &Shared,
    a: &FanoutArgs,
    imp: Impl,
    mut send: impl FnMut(&[u8]) -> Result<()>,
) -> Result<FanoutResult> {
    let mut msg = vec![0xA5u8; a.size];
    let mut last_member = new_histogram();
    let mut send_call = new_histogram();
    for seq in 0..sh.one_in_flight {
        stamp(&mut msg, seq);
        let t0 = mono_ns();
        send(&msg)?;
        let t1 = mono_ns();
        sh.wait(|| sh.rounds_done.load(Ordering::SeqCst) > seq)?;
        if seq >= a.warmup {
            last_member
                .saturating_record(sh.last_ns.load(Ordering::SeqCst).saturating_sub(t0).max(1));
            send_call.saturating_record((t1 - t0).max(1));
        }
    }
    let mut in_sends = 0u64;
    let mut min_seen = sh.one_in_flight;
    let cpu0 = (a.rdsd_pid.and_then(process_cpu_ns), own_cpu_ns());
    let start = mono_ns();
    for seq in sh.one_in_flight..sh.total {
        sh.wait_window(seq, a.window, &mut min_seen)?;
        stamp(&mut msg, seq);
        let t0 = mono_ns();
        send(&msg)?;
        in_sends += mono_ns() - t0;
    }
    sh.wait_for.store(sh.total, Ordering::SeqCst);
    sh.wait(|| sh.min_received() >= sh.total)?;
    let cpu1 = (a.rdsd_pid.and_then(process_cpu_ns), own_cpu_ns());
    let per_msg = |d: u64| d as f64 / a.messages as f64;
    let elapsed = sh.finished_ns.load(Ordering::SeqCst).saturating_sub(start);
    Ok(FanoutResult {
        imp,
        members: sh.members,
        last_member,
        send_call,
        msgs_per_s: a.messages as f64 / (elapsed.max(1) as f64 / 1e9),
        send_ns_mean: in_sends as f64 / a.messages.max(1) as f64,
        rdsd_cpu_ns: match (cpu0.0, cpu1.0) {
            (Some(x), Some(y)) => Some(per_msg(y.saturating_sub(x))),
            _ => None,
        },
        app_cpu_ns: per_msg(cpu1.1.saturating_sub(cpu0.1)),
        delivered: 0,
        expected: sh.total * sh.members as u64,
    })
}

/// Runs the members (one thread each: `makers[m]` sets up its receive call there, before the
/// sender starts) and the sender on this thread; checks every member got every message.
pub(crate) fn run<F, R>(
    a: &FanoutArgs,
    imp: Impl,
    makers: Vec<F>,
    send: impl FnMut(&[u8]) -> Result<()>,
) -> Result<FanoutResult>
where
    F: FnOnce() -> Result<R> + Send,
    R: FnMut(&mut [u8]) -> Result<usize>,
{
    let n = makers.len();
    let one = a.warmup + a.latency_count;
    let sh = Shared::new(n, one, one + a.messages);
    let ready = Barrier::new(n + 1);
    std::thread::scope(|s| {
        let threads: Vec<_> = makers
            .into_iter()
            .enumerate()
            .map(|(m, make)| {
                let (sh, ready) = (&sh, &ready);
                s.spawn(move || {
                    let recv = make();
                    ready.wait();
                    match recv {
                        Ok(recv) => member_loop(sh, m, a.size, recv),
                        Err(e) => {
                            sh.fail();
                            Err(e.context(format!("member {m} setup")))
                        }
                    }
                })
            })
            .collect();
        ready.wait();
        let r = sender_loop(&sh, a, imp, send);
        if r.is_err() {
            sh.fail();
        }
        let mut delivered = 0;
        let mut first_err = None;
        for t in threads {
            match t.join().expect("member thread panicked") {
                Ok(k) => delivered += k,
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        // A member's error says more than the sender's "a member failed".
        if let Some(e) = first_err {
            return Err(e.context(imp.key()));
        }
        let mut r = r.with_context(|| format!("{} sender", imp.key()))?;
        r.delivered = delivered;
        if r.delivered != r.expected {
            bail!(
                "{}: members got {delivered} messages, expected {}",
                imp.key(),
                r.expected
            );
        }
        Ok(r)
    })
}

/// Member sockets spread over several attachments: rdsd gives one app
/// `max_sockets_per_app` (16 by default) slots.
struct Members {
    _apps: Vec<Rdsd>,
    socks: Vec<(Socket, SocketAddrV4)>,
}

const SOCKETS_PER_ATTACHMENT: usize = 15;

fn rds_members(target: &Target, n: usize) -> Result<Members> {
    let mut apps = Vec::new();
    let mut socks = Vec::new();
    for i in 0..n {
        if i % SOCKETS_PER_ATTACHMENT == 0 {
            apps.push(target.attach()?);
        }
        let (s, addr) = bound_socket(apps.last().expect("attached"))?;
        s.set_recv_timeout(Some(Duration::from_secs(10)))?;
        socks.push((s, addr));
    }
    Ok(Members { _apps: apps, socks })
}

fn rds_recv(s: &Socket, from: SocketAddrV4) -> impl FnMut(&mut [u8]) -> Result<usize> + Send + '_ {
    move |buf| {
        let (n, src) = s.recv_from(buf).context("recv_from")?;
        if src != from {
            bail!("message from {src}, expected the sender {from}");
        }
        Ok(n)
    }
}

fn run_group(
    a: &FanoutArgs,
    target: &Target,
    rdsd: &Rdsd,
    n: usize,
    run_no: u16,
) -> Result<FanoutResult> {
    let m = rds_members(target, n)?;
    let (tx, tx_addr) = bound_socket(rdsd)?;
    tx.set_send_timeout(Some(Duration::from_secs(10)))?;
    let group = SocketAddrV4::new(Ipv4Addr::new(239, 20, 0, 1), 5000u16.wrapping_add(run_no));
    tx.group_create(group).context("group_create")?;
    for (s, _) in &m.socks {
        s.group_join(group, GroupFlags::NONE)
            .context("group_join")?;
    }
    let recvs = m
        .socks
        .iter()
        .map(|(s, _)| {
            let r = rds_recv(s, tx_addr);
            move || anyhow::Ok(r)
        })
        .collect();
    run(a, Impl::Group, recvs, |msg| {
        tx.send_to(msg, group).context("send_to(group)")?;
        Ok(())
    })
}

fn run_rds(a: &FanoutArgs, target: &Target, rdsd: &Rdsd, n: usize) -> Result<FanoutResult> {
    let m = rds_members(target, n)?;
    let (tx, tx_addr) = bound_socket(rdsd)?;
    tx.set_send_timeout(Some(Duration::from_secs(10)))?;
    let dests: Vec<SocketAddrV4> = m.socks.iter().map(|(_, a)| *a).collect();
    let recvs = m
        .socks
        .iter()
        .map(|(s, _)| {
            let r = rds_recv(s, tx_addr);
            move || anyhow::Ok(r)
        })
        .collect();
    run(a, Impl::Rds, recvs, |msg| {
        for d in &dests {
            tx.send_to(msg, *d)
                .with_context(|| format!("send_to {d}"))?;
        }
        Ok(())
    })
}

fn run_unix(a: &FanoutArgs, n: usize) -> Result<FanoutResult> {
    let mut tx: Vec<OwnedFd> = Vec::new();
    let mut rx: Vec<OwnedFd> = Vec::new();
    for _ in 0..n {
        let (t, r) = unix::seqpacket_pair()?;
        tx.push(t);
        rx.push(r);
    }
    let recvs = rx
        .into_iter()
        .map(|fd| {
            move || {
                anyhow::Ok(move |buf: &mut [u8]| -> Result<usize> {
                    let n = unix::recv(fd.as_raw_fd(), buf, 0).context("AF_UNIX recv")?;
                    if n == 0 {
                        bail!("AF_UNIX sender closed");
                    }
                    Ok(n)
                })
            }
        })
        .collect();
    run(a, Impl::Unix, recvs, move |msg| {
        for fd in &tx {
            unix::send(fd.as_raw_fd(), msg, 0).context("AF_UNIX send")?;
        }
        Ok(())
    })
}

fn pct(h: &Histogram<u64>, q: f64) -> u64 {
    h.value_at_quantile(q)
}

pub fn cmd(mut a: FanoutArgs) -> Result<()> {
    if a.size < 8 || a.size > shm_api::layout::MAX_MSG_SIZE {
        bail!("--size must be 8..=1 MiB (the first 8 bytes carry the sequence number)");
    }
    if a.members.iter().any(|&n| n == 0 || n > 1024) {
        bail!("--members: each group size must be 1..=1024");
    }
    if a.messages == 0 || a.latency_count == 0 || a.window == 0 || a.repeat == 0 {
        bail!("--messages, --latency-count, --window and --repeat must be at least 1");
    }
    // Members sleep in recv: rdsd on its default idle strategy, as for `blocking`.
    a.daemon.idle.get_or_insert_with(|| "backoff".into());
    let target = Target::open(&a.daemon)?;
    a.rdsd_pid = target.pid();
    let rdsd = target.attach()?;
    println!(
        "rds-bench fanout: {} B messages; per implementation, group size and round {} one-in-flight (+{} warm-up), then {} with a window of {}; {} round(s); members are threads with blocking receives",
        a.size, a.latency_count, a.warmup, a.messages, a.window, a.repeat
    );
    println!("  rdsd: {}", target.describe());
    let stats0 = rdsd.stats()?;
    // Rounds over every (size, implementation) pair, so that a burst of load from the rest of
    // the machine hits them all alike; each pair's rounds are then merged.
    let mut runs: Vec<FanoutResult> = Vec::new();
    let mut run_no = 0u16;
    for _ in 0..a.repeat {
        for &n in &a.members {
            for &imp in &a.impls {
                run_no += 1;
                let r = match imp {
                    Impl::Group => run_group(&a, &target, &rdsd, n, run_no)?,
                    Impl::Rds => run_rds(&a, &target, &rdsd, n)?,
                    Impl::Unix => run_unix(&a, n)?,
                    Impl::Iceoryx2 => iceoryx2_peer::run_iceoryx2(&a, n, run_no)?,
                };
                runs.push(r);
            }
        }
    }
    let mut results: Vec<FanoutResult> = Vec::new();
    for &n in &a.members {
        for &imp in &a.impls {
            let mine: Vec<FanoutResult> = runs
                .iter()
                .filter(|r| r.members == n && r.imp == imp)
                .map(FanoutResult::clone_figures)
                .collect();
            results.push(merge(mine));
        }
    }
    let stats1 = rdsd.stats()?;
    drop(rdsd);
    target.stop()?;
    let delta = |k: &str| counter(&stats1, k) - counter(&stats0, k);
    print_table(&a, &results);
    println!(
        "  rdsd counters over the run: group_sends {} group_deliveries {} group_blocked {} group_drops_full {}",
        delta("group_sends"),
        delta("group_deliveries"),
        delta("group_blocked"),
        delta("group_drops_full")
    );
    println!(
        "RESULT fanout_counters group_sends={} group_deliveries={} group_drops_full={}",
        delta("group_sends"),
        delta("group_deliveries"),
        delta("group_drops_full")
    );
    Ok(())
}

fn ratio(x: f64, base: Option<f64>) -> String {
    match base {
        Some(b) if b > 0.0 => format!("{:.2}x", x / b),
        _ => "-".into(),
    }
}

fn print_table(a: &FanoutArgs, results: &[FanoutResult]) {
    println!();
    println!(
        "  {:>3} {:<34} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} | {:>8} {:>8} | {:>8} {:>8}",
        "N",
        "",
        "last p50",
        "last p99",
        "msgs/s",
        "send p50",
        "send/msg",
        "rdsd/msg",
        "app/msg",
        "p50 /rds",
        "tput/rds",
        "p50 /unx",
        "tput/unx"
    );
    for &n in &a.members {
        let rows: Vec<&FanoutResult> = results.iter().filter(|r| r.members == n).collect();
        let find = |i: Impl| rows.iter().find(|r| r.imp == i);
        let rds = find(Impl::Rds);
        let unx = find(Impl::Unix);
        for r in &rows {
            let p50 = pct(&r.last_member, 0.5) as f64;
            println!(
                "  {:>3} {:<34} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} | {:>8} {:>8} | {:>8} {:>8}",
                n,
                r.imp.label(n),
                fmt_ns(p50),
                fmt_ns(pct(&r.last_member, 0.99) as f64),
                fmt_rate(r.msgs_per_s),
                fmt_ns(pct(&r.send_call, 0.5) as f64),
                fmt_ns(r.send_ns_mean),
                match (r.imp, r.rdsd_cpu_ns) {
                    (Impl::Group | Impl::Rds, Some(c)) => fmt_ns(c),
                    _ => "-".into(),
                },
                fmt_ns(r.app_cpu_ns),
                ratio(p50, rds.map(|b| pct(&b.last_member, 0.5) as f64)),
                ratio(r.msgs_per_s, rds.map(|b| b.msgs_per_s)),
                ratio(p50, unx.map(|b| pct(&b.last_member, 0.5) as f64)),
                ratio(r.msgs_per_s, unx.map(|b| b.msgs_per_s)),
            );
        }
    }
    println!();
    println!("  last p50/p99: send until the last member has it, one in flight; msgs/s: each to all N members, window {}", a.window);
    println!("  send p50: the sender's time in its send call(s) per message, one in flight; send/msg: the same, mean, throughput phase");
    println!("  rdsd/msg, app/msg: CPU time per message in the throughput phase, of rdsd (all threads, its backoff spinning and yielding included: an upper bound) and of this process (sender and members)");
    // The target: one group send to 16 members costs less than 4 unicast sends.
    for &n in &a.members {
        let find = |i: Impl| results.iter().find(|r| r.members == n && r.imp == i);
        if let (Some(g), Some(u)) = (find(Impl::Group), find(Impl::Rds)) {
            // Sender side: one group send_to against one unicast send_to (the fan-out's N
            // calls divided by N). End to end: unicast messages/s counts N sends each.
            let unicast_call = u.send_ns_mean / n as f64;
            let unicast_sends_per_s = u.msgs_per_s * n as f64;
            println!(
                "  N={n}: sender per group send {} vs per unicast send {} ({:.2} unicast sends); end to end a group send costs {:.2} unicast sends ({} group msgs/s vs {} unicast sends/s)",
                fmt_ns(g.send_ns_mean),
                fmt_ns(unicast_call),
                g.send_ns_mean / unicast_call.max(1e-9),
                unicast_sends_per_s / g.msgs_per_s.max(1e-9),
                fmt_rate(g.msgs_per_s),
                fmt_rate(unicast_sends_per_s)
            );
            println!(
                "RESULT fanout_target members={n} group_send_ns={:.0} unicast_send_ns={:.0} sender_cost_in_unicast_sends={:.3} e2e_cost_in_unicast_sends={:.3}",
                g.send_ns_mean,
                unicast_call,
                g.send_ns_mean / unicast_call.max(1e-9),
                unicast_sends_per_s / g.msgs_per_s.max(1e-9)
            );
        }
    }
    println!();
    for r in results {
        println!(
            "RESULT fanout impl={} members={} size={} p50_ns={} p99_ns={} msgs_per_s={:.0} send_p50_ns={} send_mean_ns={:.0} app_cpu_ns={:.0} delivered={} expected={}",
            r.imp.key(),
            r.members,
            a.size,
            pct(&r.last_member, 0.5),
            pct(&r.last_member, 0.99),
            r.msgs_per_s,
            pct(&r.send_call, 0.5),
            r.send_ns_mean,
            r.app_cpu_ns,
            r.delivered,
            r.expected
        );
    }
}

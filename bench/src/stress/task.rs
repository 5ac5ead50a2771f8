//! The rds-stress workload of one task, over any [`Chan`]: the active side keeps `depth`
//! requests in flight and times each one until its ack comes back (or, one-way, only sends);
//! the passive side answers every request with an ack. Every message starts with a 24-byte
//! header; with verification the rest is a pattern derived from the sequence number, checked
//! on arrival.

use super::chan::Chan;
use crate::util::{mono_ns, Backoff, STALL_LIMIT};
use anyhow::{bail, Result};
use hdrhistogram::Histogram;
use shm_api::hoptrace;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

/// Header: sequence number (u64), the active side's send time (u64 ns of CLOCK_MONOTONIC, echoed
/// in the ack), task (u32), flags (u32).
pub const HDR: usize = 24;
/// A request that must be answered even in a one-way run (the start-up probe).
const F_ACK_REQ: u32 = 1;
/// An ack.
const F_IS_ACK: u32 = 2;

/// What both sides agreed on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Params {
    pub tasks: u32,
    pub depth: u32,
    pub req: usize,
    pub ack: usize,
    pub one_way: bool,
    pub verify: bool,
}

/// Per-task counters: one writer (the task, plain stores), read by the reporter every second.
#[derive(Default)]
#[repr(align(128))]
pub struct Counters {
    tx: AtomicU64,
    rx: AtomicU64,
    tx_bytes: AtomicU64,
    rx_bytes: AtomicU64,
    tx_ns: AtomicU64,
    rtt_ns: AtomicU64,
    rtt_n: AtomicU64,
    verify_errors: AtomicU64,
    lost: AtomicU64,
}

/// A sum of counters at one instant.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Snap {
    pub tx: u64,
    pub rx: u64,
    pub tx_bytes: u64,
    pub rx_bytes: u64,
    pub tx_ns: u64,
    pub rtt_ns: u64,
    pub rtt_n: u64,
    pub verify_errors: u64,
    pub lost: u64,
}

impl Snap {
    pub fn sum(c: &[Counters]) -> Snap {
        let mut s = Snap::default();
        for c in c {
            s.tx += c.tx.load(Relaxed);
            s.rx += c.rx.load(Relaxed);
            s.tx_bytes += c.tx_bytes.load(Relaxed);
            s.rx_bytes += c.rx_bytes.load(Relaxed);
            s.tx_ns += c.tx_ns.load(Relaxed);
            s.rtt_ns += c.rtt_ns.load(Relaxed);
            s.rtt_n += c.rtt_n.load(Relaxed);
            s.verify_errors += c.verify_errors.load(Relaxed);
            s.lost += c.lost.load(Relaxed);
        }
        s
    }

    pub fn minus(&self, o: &Snap) -> Snap {
        Snap {
            tx: self.tx - o.tx,
            rx: self.rx - o.rx,
            tx_bytes: self.tx_bytes - o.tx_bytes,
            rx_bytes: self.rx_bytes - o.rx_bytes,
            tx_ns: self.tx_ns - o.tx_ns,
            rtt_ns: self.rtt_ns - o.rtt_ns,
            rtt_n: self.rtt_n - o.rtt_n,
            verify_errors: self.verify_errors - o.verify_errors,
            lost: self.lost - o.lost,
        }
    }
}

/// A request that can carry a hop-trace block after its header.
pub const TRACED_REQ: usize = HDR + hoptrace::BLOCK;
/// Bytes of an ack that echo the request's stamps (app send, pickup, deliver, passive recv).
const ECHO: usize = 32;
/// An ack that echoes the request's stamps and carries its own block.
pub const TRACED_ACK: usize = HDR + ECHO + hoptrace::BLOCK;

/// The hops of a traced round trip, in order; they add up to the round trip.
pub const HOPS: [&str; 7] = [
    "app -> rdsd (request: send until the poll core took it)",
    "rdsd -> peer rdsd (request: transport, wire, peer's transport, into the peer app's ring)",
    "peer rdsd -> peer app (request: ring to the app's recv)",
    "peer app (recv to send of the ack)",
    "peer app -> peer rdsd (ack)",
    "peer rdsd -> rdsd (ack)",
    "rdsd -> app (ack)",
];

/// Per-hop histograms of traced round trips (ns), and the acks that carried no stamps.
pub struct Breakdown {
    pub hops: Vec<Histogram<u64>>,
    pub untraced: u64,
}

impl Breakdown {
    pub fn new() -> Breakdown {
        Breakdown {
            hops: HOPS.iter().map(|_| crate::util::new_histogram()).collect(),
            untraced: 0,
        }
    }

    /// Records one ack (`msg`, received at `now`) that echoes its request's stamps.
    fn record(&mut self, msg: &[u8], now: u64) {
        let echo =
            |i: usize| u64::from_le_bytes(msg[HDR + 8 * i..HDR + 8 * i + 8].try_into().unwrap());
        let (Some([a_send, a_pick, a_deliv]), true) =
            (hoptrace::read(msg), msg.len() >= TRACED_ACK)
        else {
            self.untraced += 1;
            return;
        };
        let t = [
            echo(0),
            echo(1),
            echo(2),
            echo(3),
            a_send,
            a_pick,
            a_deliv,
            now,
        ];
        if t.contains(&0) || t.windows(2).any(|w| w[1] < w[0]) {
            // An rdsd without --trace-hops, or clocks that are not one clock.
            self.untraced += 1;
            return;
        }
        for (h, w) in self.hops.iter_mut().zip(t.windows(2)) {
            h.saturating_record(w[1] - w[0]);
        }
    }

    fn add(&mut self, o: &Breakdown) {
        for (a, b) in self.hops.iter_mut().zip(&o.hops) {
            let _ = a.add(b);
        }
        self.untraced += o.untraced;
    }
}

impl Default for Breakdown {
    fn default() -> Self {
        Breakdown::new()
    }
}

/// What a task shares with the others and the reporter.
pub struct Shared<'a> {
    pub p: Params,
    pub stop: &'a AtomicBool,
    /// The first verification failures, for the report.
    pub errors: &'a Mutex<Vec<String>>,
    /// The transport delivers in order and never drops.
    pub reliable: bool,
    /// Test hook (passive side): corrupt one byte of every Nth ack.
    pub corrupt_every: u64,
    /// Channels sleep (for at most `chan::SLICE`) instead of returning at once.
    pub blocking: bool,
    /// Busy-polling: give the CPU away every this many empty polls (0 = never).
    pub yield_every: u32,
    /// Active side with `--breakdown`: trace each request and collect the hops here.
    pub hops: Option<&'a Mutex<Breakdown>>,
}

impl Shared<'_> {
    fn fail(&self, ctr: &Counters, msg: String) {
        ctr.verify_errors.fetch_add(1, Relaxed);
        let mut e = self.errors.lock().unwrap_or_else(|p| p.into_inner());
        if e.is_empty() {
            eprintln!("rds-bench: verify: {msg}");
        }
        if e.len() < 8 {
            e.push(msg);
        }
    }

    fn stopped(&self) -> bool {
        self.stop.load(Relaxed)
    }
}

#[inline]
fn put_hdr(b: &mut [u8], seq: u64, ts: u64, task: u32, flags: u32) {
    b[0..8].copy_from_slice(&seq.to_le_bytes());
    b[8..16].copy_from_slice(&ts.to_le_bytes());
    b[16..20].copy_from_slice(&task.to_le_bytes());
    b[20..24].copy_from_slice(&flags.to_le_bytes());
}

#[inline]
fn get_hdr(b: &[u8]) -> (u64, u64, u32, u32) {
    (
        u64::from_le_bytes(b[0..8].try_into().expect("8")),
        u64::from_le_bytes(b[8..16].try_into().expect("8")),
        u32::from_le_bytes(b[16..20].try_into().expect("4")),
        u32::from_le_bytes(b[20..24].try_into().expect("4")),
    )
}

#[inline]
fn pat(seq: u64, i: usize) -> u8 {
    (seq as u8).wrapping_mul(31) ^ (i as u8) ^ ((i >> 8) as u8).wrapping_add(0x5A)
}

/// Fills the payload after the header with the pattern of `seq`.
pub fn fill(b: &mut [u8], seq: u64) {
    for (i, x) in b.iter_mut().enumerate().skip(HDR) {
        *x = pat(seq, i);
    }
}

/// The first payload byte that differs from the pattern of `seq`.
pub fn check(b: &[u8], seq: u64) -> Option<usize> {
    b.iter()
        .enumerate()
        .skip(HDR)
        .find(|&(i, &x)| x != pat(seq, i))
        .map(|(i, _)| i)
}

/// What is wrong with a received message, if anything: its length, its header (`bad_header`),
/// its sequence number (`out_of_order`), then its payload.
fn verify(
    m: &[u8],
    size: usize,
    bad_header: Option<String>,
    out_of_order: bool,
    expect: u64,
) -> Option<String> {
    let s = get_hdr(m).0;
    if m.len() != size {
        Some(format!("{} bytes, expected {size}", m.len()))
    } else if bad_header.is_some() {
        bad_header
    } else if out_of_order {
        Some(format!("sequence number {s}, expected {expect}"))
    } else {
        check(m, s).map(|i| {
            format!(
                "payload byte {i} is {:#04x}, expected {:#04x}",
                m[i],
                pat(s, i)
            )
        })
    }
}

/// Active task: a start-up probe (one request and its ack, not counted), then `start` (which
/// returns when every task is ready and the clock starts), then the measured loop until
/// `stop`. Records every round trip in `hist`.
pub fn active(
    ch: &mut dyn Chan,
    sh: &Shared,
    task: u32,
    ctr: &Counters,
    hist: &mut Histogram<u64>,
    start: &dyn Fn(),
) -> Result<()> {
    let p = sh.p;
    let mut req = vec![0u8; p.req];
    let mut buf = vec![0u8; p.ack.max(p.req).max(HDR) + 64];
    let mut bo = Backoff::yielding(sh.yield_every);
    // The probe: the connection (RDS/TCP paths, TCP handshake) is up before the clock starts.
    if !probe(ch, &mut req, &mut buf, 0, task, sh, STALL_LIMIT)? {
        bail!("task {task}: no answer to the first request within {STALL_LIMIT:?}");
    }
    start();

    let (mut tx, mut rx, mut tx_bytes, mut rx_bytes, mut tx_ns, mut rtt_ns) = (0u64, 0, 0, 0, 0, 0);
    let mut seq = 1u64;
    let mut expect = 1u64;
    let mut inflight = 0u32;
    let mut last_progress = mono_ns();
    let mut lost = 0u64;
    let mut hops = sh.hops.map(|_| Breakdown::new());
    while !sh.stopped() {
        let mut progressed = false;
        while p.one_way || inflight < p.depth {
            let t0 = mono_ns();
            put_hdr(&mut req, seq, t0, task, 0);
            if p.verify {
                fill(&mut req, seq);
            }
            if hops.is_some() {
                hoptrace::begin(&mut req, t0);
            }
            if !ch.send(&req)? {
                break;
            }
            let t1 = mono_ns();
            tx += 1;
            tx_bytes += req.len() as u64;
            tx_ns += t1 - t0;
            seq += 1;
            inflight += 1;
            progressed = true;
            ctr.tx.store(tx, Relaxed);
            ctr.tx_bytes.store(tx_bytes, Relaxed);
            ctr.tx_ns.store(tx_ns, Relaxed);
            if p.one_way {
                break;
            }
        }
        if !p.one_way {
            if let Some(n) = ch.recv(&mut buf)? {
                let now = mono_ns();
                progressed = true;
                if n < HDR {
                    sh.fail(
                        ctr,
                        format!("task {task}: an ack of {n} bytes (shorter than the header)"),
                    );
                } else {
                    let (s, ts, tk, fl) = get_hdr(&buf);
                    let rtt = now.saturating_sub(ts).max(1);
                    hist.saturating_record(rtt);
                    if let Some(h) = hops.as_mut() {
                        h.record(&buf[..n], now);
                    }
                    rx += 1;
                    rx_bytes += n as u64;
                    rtt_ns += rtt;
                    inflight = inflight.saturating_sub(1);
                    if p.verify {
                        let why = verify(
                            &buf[..n],
                            p.ack,
                            (fl != F_IS_ACK || tk != task)
                                .then(|| format!("header says task {tk} flags {fl:#x}")),
                            sh.reliable && s != expect,
                            expect,
                        );
                        if let Some(w) = why {
                            sh.fail(ctr, format!("task {task}: ack {s}: {w}"));
                        }
                    }
                    expect = s + 1;
                    ctr.rx.store(rx, Relaxed);
                    ctr.rx_bytes.store(rx_bytes, Relaxed);
                    ctr.rtt_ns.store(rtt_ns, Relaxed);
                    ctr.rtt_n.store(rx, Relaxed);
                }
            }
        }
        if progressed {
            last_progress = mono_ns();
            continue;
        }
        bo.snooze();
        if bo.should_check() || sh.blocking {
            let idle = mono_ns() - last_progress;
            if !sh.reliable && inflight > 0 && idle > 200_000_000 {
                // UDP dropped requests or acks: give up on them, so the run goes on.
                lost += inflight as u64;
                inflight = 0;
                ctr.lost.store(lost, Relaxed);
                last_progress = mono_ns();
            } else if idle > STALL_LIMIT.as_nanos() as u64 {
                bail!(
                    "task {task}: no progress for {STALL_LIMIT:?} ({inflight} requests in flight)"
                );
            }
        }
    }
    if p.one_way {
        // A fence: once it is answered, the passive side has counted every request before it
        // (ordered transports; UDP gets a second to catch up).
        let wait = if sh.reliable {
            STALL_LIMIT
        } else {
            std::time::Duration::from_secs(1)
        };
        if !probe(ch, &mut req, &mut buf, seq, task, sh, wait)? && sh.reliable {
            bail!("task {task}: the end-of-run fence was not answered within {wait:?}");
        }
    }
    if let (Some(mine), Some(all)) = (&hops, sh.hops) {
        all.lock().unwrap_or_else(|p| p.into_inner()).add(mine);
    }
    Ok(())
}

/// Sends one request that must be answered (`F_ACK_REQ`, not counted by either side) and
/// waits up to `limit` for its ack; false on time-out.
fn probe(
    ch: &mut dyn Chan,
    req: &mut [u8],
    buf: &mut [u8],
    seq: u64,
    task: u32,
    sh: &Shared,
    limit: std::time::Duration,
) -> Result<bool> {
    let mut bo = Backoff::yielding(sh.yield_every);
    put_hdr(req, seq, mono_ns(), task, F_ACK_REQ);
    if sh.p.verify {
        fill(req, seq);
    }
    let t0 = mono_ns();
    let late = |bo: &Backoff| bo.should_check() && mono_ns() - t0 > limit.as_nanos() as u64;
    while !ch.send(req)? {
        bo.snooze();
        if late(&bo) {
            return Ok(false);
        }
    }
    loop {
        if let Some(n) = ch.recv(buf)? {
            if n >= HDR && get_hdr(buf).0 == seq {
                return Ok(true);
            }
        }
        bo.snooze();
        if late(&bo) || mono_ns() - t0 > limit.as_nanos() as u64 {
            return Ok(mono_ns() - t0 <= limit.as_nanos() as u64);
        }
    }
}

/// Passive task: answers every request until `stop`.
pub fn passive(ch: &mut dyn Chan, sh: &Shared, ctr: &Counters) -> Result<()> {
    let p = sh.p;
    let mut buf = vec![0u8; p.req.max(HDR) + 64];
    let mut ack = vec![0u8; p.ack.max(HDR)];
    let mut bo = Backoff::yielding(sh.yield_every);
    let (mut tx, mut rx, mut tx_bytes, mut rx_bytes) = (0u64, 0u64, 0u64, 0u64);
    let mut expect = 0u64;
    let mut acks = 0u64;
    while !sh.stopped() {
        let Some(n) = ch.recv(&mut buf)? else {
            bo.snooze();
            continue;
        };
        if n < HDR {
            sh.fail(
                ctr,
                format!("a request of {n} bytes (shorter than the header)"),
            );
            continue;
        }
        let (s, ts, tk, fl) = get_hdr(&buf);
        if fl & F_ACK_REQ == 0 {
            // Probes and fences are not part of the measured traffic.
            rx += 1;
            rx_bytes += n as u64;
            ctr.rx.store(rx, Relaxed);
            ctr.rx_bytes.store(rx_bytes, Relaxed);
        }
        if p.verify {
            let why = verify(
                &buf[..n],
                p.req,
                (fl & F_IS_ACK != 0).then(|| format!("flags {fl:#x}")),
                sh.reliable && s != expect && s != 0 && fl & F_ACK_REQ == 0,
                expect,
            );
            if let Some(w) = why {
                sh.fail(ctr, format!("task {tk}: request {s}: {w}"));
            }
        }
        expect = s + 1;
        if p.one_way && fl & F_ACK_REQ == 0 {
            continue;
        }
        put_hdr(&mut ack, s, ts, tk, F_IS_ACK);
        if p.verify {
            fill(&mut ack, s);
        }
        // A traced request: echo its stamps (and when we got it) and trace the ack too.
        if let (Some(st), true) = (hoptrace::read(&buf[..n]), ack.len() >= TRACED_ACK) {
            let got = mono_ns();
            for (i, v) in st.iter().chain([got].iter()).enumerate() {
                ack[HDR + 8 * i..HDR + 8 * i + 8].copy_from_slice(&v.to_le_bytes());
            }
            hoptrace::begin(&mut ack, mono_ns());
        }
        if sh.corrupt_every > 0 && (acks + 1).is_multiple_of(sh.corrupt_every) {
            let last = ack.len() - 1;
            ack[last] ^= 0x40;
        }
        while !ch.send(&ack)? {
            if sh.stopped() {
                return Ok(());
            }
            bo.snooze();
        }
        acks += 1;
        if fl & F_ACK_REQ == 0 {
            tx += 1;
            tx_bytes += ack.len() as u64;
            ctr.tx.store(tx, Relaxed);
            ctr.tx_bytes.store(tx_bytes, Relaxed);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_catches_a_flipped_byte() {
        for len in [HDR, HDR + 1, 1024, 70_000] {
            let mut b = vec![0u8; len];
            put_hdr(&mut b, 7, 9, 3, F_IS_ACK);
            fill(&mut b, 7);
            assert_eq!(check(&b, 7), None);
            assert_eq!(get_hdr(&b), (7, 9, 3, F_IS_ACK));
            if len > HDR {
                assert!(check(&b, 8).is_some(), "another sequence number differs");
                b[len - 1] ^= 0x40;
                assert_eq!(check(&b, 7), Some(len - 1));
            }
        }
    }

    #[test]
    fn snapshots_subtract() {
        let c = [Counters::default(), Counters::default()];
        c[0].tx.store(5, Relaxed);
        c[1].tx.store(7, Relaxed);
        let a = Snap::sum(&c);
        c[1].tx.store(10, Relaxed);
        assert_eq!(Snap::sum(&c).minus(&a).tx, 3);
    }
}

//! What a run prints: rds-stress's per-second line, the `(average)` line, hdrhistogram
//! percentiles, the histogram, the comparison with the baselines, JSON and Markdown.

use super::chan::Kind;
use super::task::{Params, Snap};
use hdrhistogram::Histogram;
use serde_json::{json, Value};
use std::fmt::Write as _;
use std::time::Duration;

/// Percentiles printed and written (label, quantile).
pub const PERCENTILES: [(&str, f64); 5] = [
    ("p50", 0.50),
    ("p90", 0.90),
    ("p99", 0.99),
    ("p99.9", 0.999),
    ("p99.99", 0.9999),
];

/// One line of the report.
#[derive(Clone, Copy, Debug, Default)]
pub struct Line {
    pub tsks: u32,
    pub tx_s: f64,
    pub rx_s: f64,
    /// (tx + rx) KiB per second.
    pub kb_s: f64,
    /// µs per send call.
    pub tx_us_c: f64,
    /// Mean round trip, µs.
    pub rtt_us: f64,
    /// Busy share of all CPUs of the machine, %.
    pub cpu: f64,
}

impl Line {
    pub fn from(d: &Snap, tasks: u32, dt: Duration, cpu: f64) -> Line {
        let s = dt.as_secs_f64().max(1e-9);
        Line {
            tsks: tasks,
            tx_s: d.tx as f64 / s,
            rx_s: d.rx as f64 / s,
            kb_s: (d.tx_bytes + d.rx_bytes) as f64 / 1024.0 / s,
            tx_us_c: if d.tx > 0 {
                d.tx_ns as f64 / d.tx as f64 / 1e3
            } else {
                0.0
            },
            rtt_us: if d.rtt_n > 0 {
                d.rtt_ns as f64 / d.rtt_n as f64 / 1e3
            } else {
                0.0
            },
            cpu,
        }
    }

    fn json(&self) -> Value {
        json!({
            "tsks": self.tsks,
            "tx_per_s": self.tx_s.round(),
            "rx_per_s": self.rx_s.round(),
            "tx_rx_kib_per_s": round2(self.kb_s),
            "tx_us_per_call": round3(self.tx_us_c),
            "rtt_us": round3(self.rtt_us),
            "cpu_pct": round2(self.cpu),
        })
    }
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

pub const HEADER: &str = "tsks       tx/s       rx/s  tx+rx K/s    tx us/c     rtt us   cpu %";

pub fn line(l: &Line, tail: &str) -> String {
    format!(
        "{:>4} {:>10.0} {:>10.0} {:>10.2} {:>10.2} {:>10.2} {:>7.1}{tail}",
        l.tsks, l.tx_s, l.rx_s, l.kb_s, l.tx_us_c, l.rtt_us, l.cpu
    )
}

/// Whole-machine CPU counters from /proc/stat: (busy, total) jiffies.
pub fn cpu_sample() -> (u64, u64) {
    let s = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let v: Vec<u64> = s
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    (total - idle.min(total), total)
}

pub fn cpu_pct(a: (u64, u64), b: (u64, u64)) -> f64 {
    let dt = b.1.saturating_sub(a.1);
    if dt == 0 {
        return 0.0;
    }
    100.0 * b.0.saturating_sub(a.0) as f64 / dt as f64
}

/// Everything one run (one transport, one mode) measured on the active side, and what the
/// passive side reported.
pub struct RunResult {
    pub kind: Kind,
    pub blocking: bool,
    pub p: Params,
    pub secs: f64,
    pub per_sec: Vec<Line>,
    pub avg: Line,
    pub hist: Histogram<u64>,
    pub verify_errors: u64,
    pub lost: u64,
    /// Requests the active side sent during the measured time.
    pub sent: u64,
    pub errors: Vec<String>,
    pub passive_rx: u64,
    pub passive_tx: u64,
    pub passive_verify_errors: u64,
    pub passive_error: Option<String>,
    /// `--breakdown`: the hops of traced round trips.
    pub breakdown: Option<super::task::Breakdown>,
}

pub fn mode_name(blocking: bool) -> &'static str {
    if blocking {
        "blocking"
    } else {
        "busy-poll"
    }
}

impl RunResult {
    pub fn label(&self) -> String {
        format!("{} ({})", self.kind.label(), mode_name(self.blocking))
    }

    /// Messages per second that made it: round trips (acks) per second, or one-way
    /// deliveries counted by the passive side.
    pub fn msgs_per_s(&self) -> f64 {
        if self.p.one_way {
            self.passive_rx as f64 / self.secs.max(1e-9)
        } else {
            self.avg.rx_s
        }
    }

    /// Percentile in µs (`None` without round trips).
    pub fn pct_us(&self, q: f64) -> Option<f64> {
        (!self.hist.is_empty()).then(|| self.hist.value_at_quantile(q) as f64 / 1e3)
    }

    pub fn max_us(&self) -> Option<f64> {
        (!self.hist.is_empty()).then(|| self.hist.max() as f64 / 1e3)
    }

    pub fn total_verify_errors(&self) -> u64 {
        self.verify_errors + self.passive_verify_errors
    }

    /// The latency CDF: (µs, fraction at or below).
    pub fn cdf(&self) -> Vec<(f64, f64)> {
        let n = self.hist.len() as f64;
        if n == 0.0 {
            return Vec::new();
        }
        let mut v: Vec<(f64, f64)> = Vec::new();
        let mut cum = 0u64;
        let mut pending = None;
        for it in self.hist.iter_recorded() {
            cum += it.count_at_value();
            let pt = (
                self.hist.highest_equivalent(it.value_iterated_to()) as f64 / 1e3,
                cum as f64 / n,
            );
            // At most a few hundred points: skip those within 1% in latency and 0.1% in
            // fraction of the last one kept (the plot cannot show them apart).
            match v.last() {
                Some(&(x, y)) if pt.0 < x * 1.01 && pt.1 - y < 0.001 => pending = Some(pt),
                _ => {
                    v.push(pt);
                    pending = None;
                }
            }
        }
        v.extend(pending);
        v
    }

    pub fn json(&self) -> Value {
        let mut lat = serde_json::Map::new();
        lat.insert("count".into(), json!(self.hist.len()));
        for (k, q) in PERCENTILES {
            lat.insert(k.into(), json!(self.pct_us(q).map(round3)));
        }
        lat.insert("max".into(), json!(self.max_us().map(round3)));
        lat.insert(
            "mean".into(),
            json!((!self.hist.is_empty()).then(|| round3(self.hist.mean() / 1e3))),
        );
        json!({
            "transport": self.kind.key(),
            "label": self.kind.label(),
            "mode": mode_name(self.blocking),
            "seconds": round3(self.secs),
            "per_second": self.per_sec.iter().map(Line::json).collect::<Vec<_>>(),
            "average": self.avg.json(),
            "msgs_per_s": self.msgs_per_s().round(),
            "latency_us": Value::Object(lat),
            "verify_errors": self.verify_errors,
            "lost": self.lost,
            "sent": self.sent,
            "errors": self.errors,
            "passive": {
                "rx": self.passive_rx,
                "tx": self.passive_tx,
                "verify_errors": self.passive_verify_errors,
                "error": self.passive_error,
            },
            "breakdown": self.breakdown.as_ref().map(breakdown_json),
        })
    }
}

fn breakdown_json(b: &super::task::Breakdown) -> Value {
    json!({
        "untraced": b.untraced,
        "hops": super::task::HOPS.iter().zip(&b.hops).map(|(name, h)| json!({
            "hop": name,
            "count": h.len(),
            "p50_us": round3(h.value_at_quantile(0.5) as f64 / 1e3),
            "p90_us": round3(h.value_at_quantile(0.9) as f64 / 1e3),
            "mean_us": round3(h.mean() / 1e3),
        })).collect::<Vec<_>>(),
    })
}

/// The `--breakdown` table: each hop's p50, p90 and mean, and its share of the mean round trip.
pub fn breakdown_text(b: &super::task::Breakdown) -> String {
    let mut s = String::new();
    let total: f64 = b.hops.iter().map(|h| h.mean()).sum();
    let n = b.hops.first().map_or(0, |h| h.len());
    let _ = writeln!(
        s,
        "latency breakdown ({n} traced round trips, {} untraced):",
        b.untraced
    );
    let _ = writeln!(
        s,
        "{:>9} {:>9} {:>9} {:>6}  hop",
        "p50 us", "p90 us", "mean us", "share"
    );
    for (name, h) in super::task::HOPS.iter().zip(&b.hops) {
        let _ = writeln!(
            s,
            "{:>9.2} {:>9.2} {:>9.2} {:>5.1}%  {name}",
            h.value_at_quantile(0.5) as f64 / 1e3,
            h.value_at_quantile(0.9) as f64 / 1e3,
            h.mean() / 1e3,
            100.0 * h.mean() / total.max(1e-9)
        );
    }
    let _ = writeln!(
        s,
        "{:>29.2}         sum of the means (the mean round trip)",
        total / 1e3
    );
    s
}

/// Title line of a run.
pub fn run_title(kind: Kind, blocking: bool, p: &Params, secs: u64, route: &str) -> String {
    let work = if p.one_way {
        format!("{} B one-way", p.req)
    } else {
        format!("{} B requests, {} B acks", p.req, p.ack)
    };
    format!(
        "== {} ({} apps): {} task{}, depth {}, {work}, {secs} s, {route}{}",
        kind.label(),
        mode_name(blocking),
        p.tasks,
        if p.tasks == 1 { "" } else { "s" },
        p.depth,
        if p.verify { ", payloads verified" } else { "" }
    )
}

/// The `(average)` line, percentiles and (optionally) the histogram.
pub fn summary(r: &RunResult, show_histogram: bool) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "{}", line(&r.avg, "  (average)"));
    if r.hist.is_empty() {
        let _ = writeln!(
            s,
            "one-way: no round trips timed; sent {}, the passive side received {} ({:.0}/s){}",
            r.sent,
            r.passive_rx.saturating_sub(1),
            r.msgs_per_s(),
            if r.passive_rx.saturating_sub(1) < r.sent {
                format!(
                    ", {} not delivered",
                    r.sent - r.passive_rx.saturating_sub(1)
                )
            } else {
                String::new()
            }
        );
    } else {
        let _ = writeln!(s, "rtt percentiles (us, {} round trips):", r.hist.len());
        for (k, q) in PERCENTILES {
            let _ = writeln!(s, "{k:>10} {:>12.2}", r.pct_us(q).unwrap_or(0.0));
        }
        let _ = writeln!(s, "{:>10} {:>12.2}", "max", r.max_us().unwrap_or(0.0));
    }
    if let Some(b) = &r.breakdown {
        s.push_str(&breakdown_text(b));
    }
    if show_histogram && !r.hist.is_empty() {
        let _ = writeln!(s, "rtt histogram (us):");
        let _ = writeln!(s, "{:>12} {:>12} {:>9}", "up to", "count", "cum %");
        let n = r.hist.len() as f64;
        let mut cum = 0u64;
        for it in r.hist.iter_log(250, 2.0) {
            let c = it.count_since_last_iteration();
            cum += c;
            if c > 0 {
                let _ = writeln!(
                    s,
                    "{:>12.2} {:>12} {:>8.3}%",
                    it.value_iterated_to() as f64 / 1e3,
                    c,
                    100.0 * cum as f64 / n
                );
            }
        }
    }
    if r.lost > 0 {
        let _ = writeln!(s, "lost: {} requests or acks never came back", r.lost);
    }
    if r.total_verify_errors() > 0 {
        let _ = writeln!(
            s,
            "VERIFY FAILED: {} corrupted messages seen by the active side, {} by the passive side",
            r.verify_errors, r.passive_verify_errors
        );
        for e in &r.errors {
            let _ = writeln!(s, "  {e}");
        }
    }
    s
}

fn fmt_us(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| {
        if v < 100.0 {
            format!("{v:.2} us")
        } else {
            format!("{v:.0} us")
        }
    })
}

fn fmt_rate(r: f64) -> String {
    crate::util::fmt_rate(r)
}

/// One comparison row: rdsd's figure against a baseline of the same mode.
pub struct Ratio<'a> {
    pub rds: &'a RunResult,
    pub base: &'a RunResult,
}

impl Ratio<'_> {
    /// rdsd msgs/s over the baseline's (> 1: rdsd moves more).
    pub fn rate(&self) -> f64 {
        self.rds.msgs_per_s() / self.base.msgs_per_s().max(1e-9)
    }

    /// Baseline p50 over rdsd's (> 1: rdsd is quicker).
    pub fn p50(&self) -> Option<f64> {
        Some(self.base.pct_us(0.5)? / self.rds.pct_us(0.5)?.max(1e-9))
    }

    pub fn p99(&self) -> Option<f64> {
        Some(self.base.pct_us(0.99)? / self.rds.pct_us(0.99)?.max(1e-9))
    }
}

/// Every (rdsd, baseline) pair of the same mode.
pub fn ratios(runs: &[RunResult]) -> Vec<Ratio<'_>> {
    let mut v = Vec::new();
    for rds in runs.iter().filter(|r| r.kind == Kind::Rds) {
        for base in runs
            .iter()
            .filter(|b| b.kind != Kind::Rds && b.blocking == rds.blocking)
        {
            v.push(Ratio { rds, base });
        }
    }
    v
}

fn fmt_x(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{v:.2}x"))
}

/// The comparison table (text).
pub fn comparison(runs: &[RunResult]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "comparison, same workload and run (speed-up = rdsd / baseline msgs/s, baseline / rdsd latency; > 1: rdsd better):"
    );
    let _ = writeln!(
        s,
        "  {:<32} {:>10} {:>10} {:>10} {:>10} {:>14} {:>10} {:>10}",
        "", "msgs/s", "rtt p50", "rtt p99", "p99.99", "msgs/s ratio", "p50 ratio", "p99 ratio"
    );
    for blocking in [false, true] {
        let Some(rds) = runs
            .iter()
            .find(|r| r.kind == Kind::Rds && r.blocking == blocking)
        else {
            for r in runs.iter().filter(|r| r.blocking == blocking) {
                let _ = writeln!(s, "  {}", row(r, None));
            }
            continue;
        };
        let _ = writeln!(s, "  {}", row(rds, None));
        for base in runs
            .iter()
            .filter(|b| b.kind != Kind::Rds && b.blocking == blocking)
        {
            let _ = writeln!(s, "  {}", row(base, Some(&Ratio { rds, base })));
        }
    }
    s
}

fn row(r: &RunResult, ratio: Option<&Ratio>) -> String {
    format!(
        "{:<32} {:>10} {:>10} {:>10} {:>10} {:>14} {:>10} {:>10}",
        r.label(),
        fmt_rate(r.msgs_per_s()),
        fmt_us(r.pct_us(0.5)),
        fmt_us(r.pct_us(0.99)),
        fmt_us(r.pct_us(0.9999)),
        ratio.map_or("rdsd".into(), |x| format!("{:.2}x", x.rate())),
        ratio.map_or(String::new(), |x| fmt_x(x.p50())),
        ratio.map_or(String::new(), |x| fmt_x(x.p99())),
    )
}

/// The comparison as a Markdown table.
pub fn markdown(runs: &[RunResult]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| transport (apps) | msgs/s | rtt p50 | p90 | p99 | p99.9 | p99.99 | max | cpu % | rdsd speed-up: msgs/s | p50 | p99 |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in runs {
        let rds = runs
            .iter()
            .find(|x| x.kind == Kind::Rds && x.blocking == r.blocking && r.kind != Kind::Rds);
        let ratio = rds.map(|rds| Ratio { rds, base: r });
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {:.0} | {} | {} | {} |",
            if r.kind == Kind::Rds {
                format!("**{}**", r.label())
            } else {
                r.label()
            },
            fmt_rate(r.msgs_per_s()),
            fmt_us(r.pct_us(0.5)),
            fmt_us(r.pct_us(0.9)),
            fmt_us(r.pct_us(0.99)),
            fmt_us(r.pct_us(0.999)),
            fmt_us(r.pct_us(0.9999)),
            fmt_us(r.max_us()),
            r.avg.cpu,
            ratio
                .as_ref()
                .map_or("—".into(), |x| format!("**{:.2}×**", x.rate())),
            ratio
                .as_ref()
                .map_or("—".into(), |x| fmt_x(x.p50()).replace('x', "×")),
            ratio
                .as_ref()
                .map_or("—".into(), |x| fmt_x(x.p99()).replace('x', "×")),
        );
    }
    s
}

/// The JSON document of a whole invocation.
pub fn document(
    p: &Params,
    secs: u64,
    local: &str,
    peer: &str,
    runs: &[RunResult],
    plots: Option<(&str, &str)>,
) -> Value {
    json!({
        "tool": "rds-bench",
        "version": env!("CARGO_PKG_VERSION"),
        "role": "active",
        "params": {
            "tasks": p.tasks,
            "depth": p.depth,
            "req_bytes": p.req,
            "ack_bytes": p.ack,
            "seconds": secs,
            "one_way": p.one_way,
            "verify": p.verify,
            "local": local,
            "peer": peer,
        },
        "runs": runs.iter().map(RunResult::json).collect::<Vec<_>>(),
        "comparison": ratios(runs).iter().map(|x| json!({
            "mode": mode_name(x.rds.blocking),
            "baseline": x.base.kind.key(),
            "msgs_per_s_ratio": round3(x.rate()),
            "p50_ratio": x.p50().map(round3),
            "p99_ratio": x.p99().map(round3),
        })).collect::<Vec<_>>(),
        "plots": plots.map(|(a, b)| json!({"latency_cdf": a, "throughput": b})),
    })
}

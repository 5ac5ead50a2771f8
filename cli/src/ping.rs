//! `rdsctl ping ADDR`, like rds-ping: an RDS socket (attached to rdsd through shm-api) sends
//! empty messages to ADDR port 0; the RDS engine (or, for a local address, rdsd's loopback
//! transport) answers each with an empty pong from ADDR port 0. One line per reply.

use serde_json::json;
use shm_api::Rdsd;
use std::io::{self, Write};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::Path;
use std::time::{Duration, Instant};

/// What `ping` was asked to do.
pub struct PingArgs {
    /// Destination (port 0 is implied).
    pub dest: Ipv4Addr,
    /// Pings to send; `None` = until interrupted.
    pub count: Option<u64>,
    /// Between two pings.
    pub interval: Duration,
    /// Longest wait for one reply.
    pub timeout: Duration,
    /// Print one JSON document at the end instead of lines.
    pub json: bool,
}

/// The address a ping to `dest` is sent from when no `-I` is given: `dest` itself when rdsd
/// owns it (as the kernel's route lookup would pick), else rdsd's first configured local
/// address (a /32, or the first host of a wider prefix).
pub fn default_source(local_addrs: &[String], dest: Ipv4Addr) -> Option<Ipv4Addr> {
    let prefixes: Vec<(Ipv4Addr, u8)> = local_addrs
        .iter()
        .filter_map(|p| {
            let (a, l) = p.split_once('/').unwrap_or((p, "32"));
            Some((a.parse().ok()?, l.parse().ok().filter(|l| *l <= 32)?))
        })
        .collect();
    let contains = |(a, l): (Ipv4Addr, u8), ip: Ipv4Addr| {
        let mask = if l == 0 { 0 } else { u32::MAX << (32 - l) };
        u32::from(ip) & mask == u32::from(a) & mask
    };
    if prefixes.iter().any(|&p| contains(p, dest)) {
        return Some(dest);
    }
    let &(a, l) = prefixes.first()?;
    Some(if l >= 31 {
        a
    } else {
        let mask = u32::MAX << (32 - l.max(1));
        Ipv4Addr::from((u32::from(a) & mask) + 1)
    })
}

/// Outcome of a ping run.
pub struct PingResult {
    /// Pings sent.
    pub sent: u64,
    /// Replies received.
    pub received: u64,
}

/// Runs the pings. Errors are setup failures (attach, bind) or a send that failed.
pub fn run(path: &Path, a: &PingArgs, source: Ipv4Addr) -> io::Result<PingResult> {
    let rdsd = Rdsd::attach_at(path)?;
    let sock = rdsd.socket()?;
    sock.bind(SocketAddrV4::new(source, 0))
        .map_err(|e| io::Error::new(e.kind(), format!("bind {source}: {e}")))?;
    let bound = sock.local_addr().expect("bound");
    let dest = SocketAddrV4::new(a.dest, 0);
    let mut out = io::stdout().lock();
    if !a.json {
        let _ = writeln!(out, "RDS ping {} from {bound}", a.dest);
        let _ = out.flush();
    }
    let mut buf = [0u8; 64];
    let (mut sent, mut rtts, mut lost) = (0u64, Vec::new(), Vec::new());
    let mut seq = 0u64;
    while a.count.is_none_or(|c| seq < c) {
        seq += 1;
        // Forget late pongs of earlier pings: replies carry no sequence number.
        sock.set_nonblocking(true)?;
        while sock.recv_from(&mut buf).is_ok() {}
        sock.set_nonblocking(false)?;
        let t0 = Instant::now();
        sock.send_to(&[], dest)
            .map_err(|e| io::Error::new(e.kind(), format!("send to {dest}: {e}")))?;
        sent += 1;
        let deadline = t0 + a.timeout;
        let rtt = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break None;
            }
            sock.set_recv_timeout(Some(left))?;
            match sock.recv_from(&mut buf) {
                Ok((_, from)) if from == dest => break Some(t0.elapsed()),
                Ok(_) => continue, // a congestion notification, or a stray message
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
                    ) =>
                {
                    break None
                }
                Err(e) => return Err(e),
            }
        };
        match rtt {
            Some(d) => {
                let us = d.as_micros() as u64;
                rtts.push((seq, us));
                if !a.json {
                    let _ = writeln!(out, "{seq:4}: {us} usec");
                    let _ = out.flush();
                }
            }
            None => {
                lost.push(seq);
                if !a.json {
                    eprintln!("{seq:4}: no reply within {:.3} s", a.timeout.as_secs_f64());
                }
            }
        }
        if a.count.is_some_and(|c| seq >= c) {
            break;
        }
        let next = t0 + a.interval;
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
    }
    let received = rtts.len() as u64;
    let us: Vec<u64> = rtts.iter().map(|r| r.1).collect();
    let (min, max) = (us.iter().min().copied(), us.iter().max().copied());
    let avg = (!us.is_empty()).then(|| us.iter().sum::<u64>() as f64 / us.len() as f64);
    let loss = if sent == 0 {
        0.0
    } else {
        100.0 * (sent - received) as f64 / sent as f64
    };
    if a.json {
        let doc = json!({
            "target": a.dest,
            "source": bound.ip(),
            "sent": sent,
            "received": received,
            "loss_percent": loss,
            "replies": rtts.iter().map(|(s, u)| json!({"seq": s, "rtt_us": u})).collect::<Vec<_>>(),
            "lost": lost,
            "rtt_us": {"min": min, "avg": avg, "max": max},
        });
        let _ = writeln!(out, "{}", serde_json::to_string_pretty(&doc).expect("json"));
    } else {
        let _ = writeln!(
            out,
            "--- {} RDS ping: {sent} sent, {received} received, {loss:.0}% loss{}",
            a.dest,
            match (min, avg, max) {
                (Some(mn), Some(av), Some(mx)) =>
                    format!(", rtt min/avg/max {mn}/{av:.0}/{mx} usec"),
                _ => String::new(),
            }
        );
    }
    Ok(PingResult { sent, received })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &[&str]) -> Vec<String> {
        s.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn source_is_the_destination_when_local_else_the_first_local_address() {
        let ip = |s: &str| s.parse::<Ipv4Addr>().unwrap();
        let lo = v(&["127.0.0.0/8"]);
        assert_eq!(default_source(&lo, ip("127.0.0.9")), Some(ip("127.0.0.9")));
        assert_eq!(default_source(&lo, ip("10.0.0.2")), Some(ip("127.0.0.1")));
        let lab = v(&["10.9.0.1/32", "127.0.0.0/8"]);
        assert_eq!(default_source(&lab, ip("10.9.0.2")), Some(ip("10.9.0.1")));
        assert_eq!(default_source(&lab, ip("127.0.0.1")), Some(ip("127.0.0.1")));
        assert_eq!(
            default_source(&v(&["10.1.0.0/16"]), ip("8.8.8.8")),
            Some(ip("10.1.0.1"))
        );
        assert_eq!(
            default_source(&v(&["10.1.0.7"]), ip("8.8.8.8")),
            Some(ip("10.1.0.7"))
        );
        assert_eq!(default_source(&[], ip("8.8.8.8")), None);
        assert_eq!(default_source(&v(&["junk"]), ip("8.8.8.8")), None);
    }
}

//! The Prometheus metrics endpoint (`metrics_listen`, off by default): a tiny HTTP/1.0
//! responder on a thread of its own, so neither the poll core nor the control thread ever
//! waits on a scraper. `GET /metrics` answers the counters in the text exposition format
//! (`shm_api::ctrl::prometheus_text`, the same text as `rdsctl stats --prometheus`); one
//! connection at a time, each bounded by a 2 s I/O deadline and an 8 KiB request.

use crate::stats::Stats;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Longest a scraper may take to send its request or read the answer.
const IO_TIMEOUT: Duration = Duration::from_secs(2);
/// Largest request head read.
const MAX_REQUEST: usize = 8 * 1024;

/// The exposition text of `stats`.
pub fn render(stats: &Stats, start_unix: f64) -> String {
    let d = stats.described();
    let list: Vec<(&str, u64, &str)> = d.iter().map(|(k, v, h)| (k.as_str(), *v, *h)).collect();
    let mut text =
        shm_api::ctrl::prometheus_text(&list, Some((env!("CARGO_PKG_VERSION"), start_unix)));
    let per = stats.per_thread();
    text.push_str(&shm_api::ctrl::prometheus_thread_text(
        per.len(),
        |k, name| {
            per[k]
                .iter()
                .find(|(n, _)| n == name)
                .map_or(0, |&(_, v)| v)
        },
    ));
    text
}

/// Binds `addr` (so a bad address fails rdsd's start) and serves it on a new thread until
/// `shutdown`.
pub fn spawn(
    addr: SocketAddr,
    stats: Arc<Stats>,
    shutdown: Arc<AtomicBool>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    let listener = TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    let start_unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    tracing::info!(listen = %listener.local_addr()?, "metrics endpoint serving /metrics");
    std::thread::Builder::new()
        .name("rdsd-metrics".into())
        .spawn(move || {
            use std::os::fd::AsRawFd;
            while !shutdown.load(Ordering::Relaxed) {
                // Wake at least every 200 ms to see a shutdown.
                let ready = shm_api::sys::poll_one(listener.as_raw_fd(), libc::POLLIN, 200);
                if !matches!(ready, Ok(r) if r != 0) {
                    continue;
                }
                while let Ok((conn, _)) = listener.accept() {
                    if let Err(e) = serve(conn, &stats, start_unix) {
                        tracing::debug!(error = %e, "metrics request failed");
                    }
                }
            }
        })
}

/// The status line and body for a request head.
fn respond(head: &str, stats: &Stats, start_unix: f64) -> (&'static str, &'static str, String) {
    let mut words = head.lines().next().unwrap_or("").split_whitespace();
    let (method, target) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    const TEXT: &str = "text/plain; charset=utf-8";
    match (method, path) {
        ("GET" | "HEAD", "/metrics") => (
            "200 OK",
            "text/plain; version=0.0.4; charset=utf-8",
            render(stats, start_unix),
        ),
        ("GET" | "HEAD", "/") => ("200 OK", TEXT, "rdsd: metrics at /metrics\n".into()),
        ("GET" | "HEAD", _) => ("404 Not Found", TEXT, "not found; try /metrics\n".into()),
        _ => ("405 Method Not Allowed", TEXT, "only GET\n".into()),
    }
}

fn serve(mut conn: TcpStream, stats: &Stats, start_unix: f64) -> std::io::Result<()> {
    conn.set_nonblocking(false)?;
    conn.set_read_timeout(Some(IO_TIMEOUT))?;
    conn.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") && !buf.windows(2).any(|w| w == b"\n\n") {
        let n = conn.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.len() > MAX_REQUEST {
            break;
        }
    }
    let head = String::from_utf8_lossy(&buf);
    let (status, ctype, body) = respond(&head, stats, start_unix);
    let head_only = head.starts_with("HEAD ");
    let mut out = format!(
        "HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    if !head_only {
        out.push_str(&body);
    }
    conn.write_all(out.as_bytes())?;
    let _ = conn.shutdown(std::net::Shutdown::Write);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serves_metrics_and_refuses_the_rest() {
        let stats = Arc::new(Stats::default());
        Stats::bump(&stats.apps_attached);
        let shutdown = Arc::new(AtomicBool::new(false));
        let probe = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = probe.local_addr().unwrap();
        drop(probe);
        let t = spawn(addr, stats.clone(), shutdown.clone()).unwrap();
        let get = |req: &str| {
            let mut c = TcpStream::connect(addr).unwrap();
            c.write_all(req.as_bytes()).unwrap();
            let mut s = String::new();
            c.read_to_string(&mut s).unwrap();
            s
        };
        let r = get("GET /metrics HTTP/1.0\r\n\r\n");
        assert!(r.starts_with("HTTP/1.0 200 OK\r\n"), "{r}");
        assert!(r.contains("Content-Type: text/plain; version=0.0.4"), "{r}");
        assert!(r.contains("\nrdsd_apps_attached_total 1\n"), "{r}");
        let body = r.split("\r\n\r\n").nth(1).unwrap();
        let len: usize = r
            .lines()
            .find_map(|l| l.strip_prefix("Content-Length: "))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert_eq!(body.len(), len);
        assert!(get("GET /nope HTTP/1.1\r\nHost: x\r\n\r\n").starts_with("HTTP/1.0 404"));
        assert!(get("POST /metrics HTTP/1.0\r\n\r\n").starts_with("HTTP/1.0 405"));
        let h = get("HEAD /metrics HTTP/1.0\r\n\r\n");
        assert!(
            h.starts_with("HTTP/1.0 200") && h.ends_with("\r\n\r\n"),
            "{h}"
        );
        // A second bind of the same address fails (rdsd refuses to start).
        assert!(spawn(addr, stats, shutdown.clone()).is_err());
        shutdown.store(true, Ordering::Relaxed);
        t.join().unwrap();
    }
}

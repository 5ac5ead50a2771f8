//! The rdsd side of the benchmarks: busy-polling ping-pong, one-way streaming, and a blocking
//! echo peer in another process.

use crate::util::{
    check_payload, new_histogram, pin, stamp, would_block, Backoff, Latency, Throughput,
    STALL_LIMIT,
};
use anyhow::{bail, Context, Result};
use shm_api::{Rdsd, Socket};
use std::io::{BufRead, BufReader, Write};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

/// `127.0.0.1:0`: rdsd picks the port.
pub fn any_port() -> SocketAddrV4 {
    SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0)
}

/// An rdsd socket bound to 127.0.0.1 on a free port.
pub fn bound_socket(rdsd: &Rdsd) -> Result<(Socket, SocketAddrV4)> {
    let s = rdsd.socket().context("cannot open an rdsd socket")?;
    s.bind(any_port())
        .context("cannot bind an rdsd socket to 127.0.0.1")?;
    let a = s.local_addr().context("bound socket has no address")?;
    Ok((s, a))
}

/// One retry of a busy-polling send or receive that found nothing to do: backs off, and gives
/// up once the other thread stopped or nothing moved for `STALL_LIMIT` (`since`: when the
/// first retry came; `what`: what did not happen, for the error).
fn back_off(
    bo: &mut Backoff,
    since: &mut Option<Instant>,
    stop: Option<&AtomicBool>,
    what: impl FnOnce() -> String,
) -> Result<()> {
    bo.snooze();
    if bo.should_check() {
        if stop.is_some_and(|f| f.load(Ordering::Relaxed)) {
            bail!("stopped by the other thread");
        }
        let t = *since.get_or_insert_with(Instant::now);
        if t.elapsed() > STALL_LIMIT {
            bail!(
                "{} for {STALL_LIMIT:?} (is rdsd's poll thread running?)",
                what()
            );
        }
    }
    Ok(())
}

/// Sends every message of `msgs` to `to` with `Socket::send_batch` (non-blocking), going on
/// from where a partial batch stopped; returns the retries.
fn send_batch_spin(
    s: &Socket,
    msgs: &[Vec<u8>],
    to: SocketAddrV4,
    bo: &mut Backoff,
    stop: Option<&AtomicBool>,
) -> Result<u64> {
    let mut retries = 0u64;
    let mut done = 0;
    let mut since: Option<Instant> = None;
    let mut batch: Vec<(&[u8], Option<SocketAddrV4>)> = Vec::with_capacity(msgs.len());
    while done < msgs.len() {
        batch.clear();
        batch.extend(msgs[done..].iter().map(|m| (&m[..], Some(to))));
        match s.send_batch(&batch, true) {
            Ok(n) => done += n,
            Err(e) if would_block(&e) => {
                retries += 1;
                back_off(bo, &mut since, stop, || {
                    format!("send to {to} found no room")
                })?;
            }
            Err(e) => return Err(e).with_context(|| format!("send_batch to {to}")),
        }
    }
    Ok(retries)
}

/// Sends on a non-blocking socket, retrying while the ring is full or the peer congested.
#[inline]
fn send_spin(
    s: &Socket,
    buf: &[u8],
    to: SocketAddrV4,
    bo: &mut Backoff,
    stop: Option<&AtomicBool>,
) -> Result<u64> {
    let mut retries = 0u64;
    let mut since: Option<Instant> = None;
    loop {
        match s.send_to(buf, to) {
            Ok(_) => return Ok(retries),
            Err(e) if would_block(&e) => {
                retries += 1;
                back_off(bo, &mut since, stop, || {
                    format!("send to {to} found no room")
                })?;
            }
            Err(e) => return Err(e).with_context(|| format!("send_to {to}")),
        }
    }
}

/// Receives on a non-blocking socket, busy-polling until a message is there.
#[inline]
fn recv_spin(
    s: &Socket,
    buf: &mut [u8],
    bo: &mut Backoff,
    stop: Option<&AtomicBool>,
) -> Result<usize> {
    let mut since: Option<Instant> = None;
    loop {
        match s.recv_from(buf) {
            Ok((n, _)) => return Ok(n),
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                back_off(bo, &mut since, stop, || "nothing received".to_string())?;
            }
            Err(e) => return Err(e).context("recv_from"),
        }
    }
}

/// Receives at least one message into `bufs` with `Socket::recv_batch` (non-blocking, so
/// whatever is queued, up to `bufs.len()`), backing off while nothing is; returns each
/// message's buffer and length.
fn recv_batch_spin<'a>(
    s: &Socket,
    bufs: &'a mut [Vec<u8>],
    bo: &mut Backoff,
    stop: Option<&AtomicBool>,
) -> Result<Vec<(&'a [u8], usize)>> {
    let mut since: Option<Instant> = None;
    let mut out = vec![shm_api::RecvMsg::default(); bufs.len()];
    let flags = shm_api::RecvFlags {
        dontwait: true,
        ..Default::default()
    };
    loop {
        let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
        match s.recv_batch(&mut slices, &mut out, flags) {
            Ok(k) => {
                return Ok(bufs
                    .iter()
                    .zip(&out)
                    .take(k)
                    .map(|(b, m)| (&b[..], m.len))
                    .collect())
            }
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                back_off(bo, &mut since, stop, || "nothing received".to_string())?;
            }
            Err(e) => return Err(e).context("recv_batch"),
        }
    }
}

/// One app thread, two sockets: A → B, B → A, both busy-polling non-blocking receives.
/// The calling thread is pinned to `core` (unpinned with `None`). With `yield_every` > 0 it
/// gives the CPU away every so many misses, in case it shares a core with rdsd's poll thread.
pub fn rtt(
    rdsd: &Rdsd,
    count: u64,
    warmup: u64,
    size: usize,
    core: Option<usize>,
    yield_every: u32,
) -> Result<Latency> {
    let (a, a_addr) = bound_socket(rdsd)?;
    let (b, b_addr) = bound_socket(rdsd)?;
    a.set_nonblocking(true)?;
    b.set_nonblocking(true)?;
    pin(core);
    let mut msg = vec![0x5Au8; size];
    let mut rbuf = vec![0u8; size + 64];
    let mut hist = new_histogram();
    let mut bo = Backoff::yielding(yield_every);
    let mut start = Instant::now();
    for i in 0..warmup + count {
        stamp(&mut msg, i);
        if i == warmup {
            start = Instant::now();
        }
        let t0 = Instant::now();
        send_spin(&a, &msg, b_addr, &mut bo, None)?;
        let n = recv_spin(&b, &mut rbuf, &mut bo, None)?;
        send_spin(&b, &rbuf[..n], a_addr, &mut bo, None)?;
        let n = recv_spin(&a, &mut rbuf, &mut bo, None)?;
        let dt = t0.elapsed();
        check_payload(&rbuf, n, size, i)?;
        if i >= warmup {
            hist.saturating_record(dt.as_nanos().max(1) as u64);
        }
    }
    Ok(Latency::from_histogram(&hist, start.elapsed()))
}

/// One-way stream from a sender thread (socket A) to a receiver thread (socket B) of the same
/// process. Both busy-poll; they give the CPU away every `yield_every` misses because on a small
/// machine they may share a core (0 = never).
#[allow(clippy::too_many_arguments)]
pub fn tput(
    rdsd: &Rdsd,
    count: u64,
    size: usize,
    sender_core: Option<usize>,
    receiver_core: Option<usize>,
    yield_every: u32,
    batch: usize,
) -> Result<Throughput> {
    if count < 2 {
        bail!("--count must be at least 2");
    }
    let (a, _) = bound_socket(rdsd)?;
    let (b, b_addr) = bound_socket(rdsd)?;
    // Large buffers: the receiver's port must not turn congested, and the sender may queue a
    // whole ring (the rings themselves bound what is in flight).
    b.set_recv_buffer_size(16 << 20)?;
    a.set_send_buffer_size(16 << 20)?;
    a.set_nonblocking(true)?;
    b.set_nonblocking(true)?;
    let stop = AtomicBool::new(false);
    let go = Barrier::new(2);
    std::thread::scope(|s| {
        let rx = s.spawn(|| -> Result<(Instant, Instant)> {
            pin(receiver_core);
            go.wait();
            let r = (|| -> Result<(Instant, Instant)> {
                let mut buf = vec![0u8; size + 64];
                let mut bo = Backoff::yielding(yield_every);
                let n = recv_spin(&b, &mut buf, &mut bo, Some(&stop))?;
                let first = Instant::now();
                check_payload(&buf, n, size, 0)?;
                if batch > 1 {
                    // recvmmsg-style: whatever is queued, up to `batch`, released together.
                    let mut bufs = vec![vec![0u8; size + 64]; batch];
                    let mut i = 1;
                    while i < count {
                        let want = (count - i).min(batch as u64) as usize;
                        let got = recv_batch_spin(&b, &mut bufs[..want], &mut bo, Some(&stop))?;
                        for (k, (buf, n)) in got.iter().enumerate() {
                            check_payload(buf, *n, size, i + k as u64)?;
                        }
                        i += got.len() as u64;
                    }
                    return Ok((first, Instant::now()));
                }
                for i in 1..count {
                    let n = recv_spin(&b, &mut buf, &mut bo, Some(&stop))?;
                    check_payload(&buf, n, size, i)?;
                }
                Ok((first, Instant::now()))
            })();
            if r.is_err() {
                stop.store(true, Ordering::Relaxed);
            }
            r
        });
        let tx = s.spawn(|| -> Result<u64> {
            pin(sender_core);
            go.wait();
            let r = (|| -> Result<u64> {
                let mut msg = vec![0xC3u8; size];
                let mut bo = Backoff::yielding(yield_every);
                let mut retries = 0;
                if batch > 1 {
                    // sendmmsg-style: `batch` messages per call, published together.
                    let mut msgs = vec![vec![0xC3u8; size]; batch];
                    let mut i = 0;
                    while i < count {
                        let n = (count - i).min(batch as u64) as usize;
                        for (k, m) in msgs[..n].iter_mut().enumerate() {
                            stamp(m, i + k as u64);
                        }
                        retries += send_batch_spin(&a, &msgs[..n], b_addr, &mut bo, Some(&stop))?;
                        i += n as u64;
                    }
                    return Ok(retries);
                }
                for i in 0..count {
                    stamp(&mut msg, i);
                    retries += send_spin(&a, &msg, b_addr, &mut bo, Some(&stop))?;
                }
                Ok(retries)
            })();
            if r.is_err() {
                stop.store(true, Ordering::Relaxed);
            }
            r
        });
        let rx = rx.join().expect("receiver thread panicked");
        let tx = tx.join().expect("sender thread panicked");
        let (first, last) = rx.context("receiver")?;
        let retries = tx.context("sender")?;
        Ok(Throughput {
            count,
            size,
            elapsed: last - first,
            retries,
        })
    })
}

/// `__rds-echo`: attaches to rdsd, binds, prints `port N`, then echoes every message back to
/// its sender with blocking calls until it gets `BYE` (or nothing for 10 s).
pub fn echo_main(socket: &std::path::Path) -> Result<()> {
    let rdsd = Rdsd::attach_at(socket)
        .with_context(|| format!("echo: cannot attach to {}", socket.display()))?;
    let (s, addr) = bound_socket(&rdsd)?;
    s.set_recv_timeout(Some(Duration::from_secs(10)))?;
    println!("port {}", addr.port());
    std::io::stdout().flush()?;
    let mut buf = vec![0u8; shm_api::layout::MAX_MSG_SIZE];
    loop {
        let (n, from) = s.recv_from(&mut buf).context("echo: recv")?;
        if &buf[..n] == BYE {
            return Ok(());
        }
        s.send_to(&buf[..n], from).context("echo: send")?;
    }
}

const BYE: &[u8] = b"rds-bench: bye";

/// Ping-pong with an echo process (`__rds-echo`), blocking sockets on both sides: the path
/// that sleeps in futex_wait and is woken by rdsd.
pub fn two_process_rtt(
    rdsd: &Rdsd,
    socket: &std::path::Path,
    count: u64,
    size: usize,
) -> Result<Latency> {
    let exe = std::env::current_exe()?;
    let mut child = Command::new(exe)
        .arg("__rds-echo")
        .arg("--socket")
        .arg(socket)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("cannot start the echo process")?;
    let res = (|| -> Result<Latency> {
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line)?;
        let port: u16 = line
            .strip_prefix("port ")
            .and_then(|p| p.trim().parse().ok())
            .with_context(|| format!("echo process said {line:?} instead of its port"))?;
        let peer = SocketAddrV4::new(Ipv4Addr::LOCALHOST, port);
        let (s, _) = bound_socket(rdsd)?;
        s.set_recv_timeout(Some(Duration::from_secs(10)))?;
        let mut msg = vec![0x77u8; size.max(8)];
        let mut buf = vec![0u8; size.max(8) + 64];
        let mut hist = new_histogram();
        let start = Instant::now();
        for i in 0..count {
            stamp(&mut msg, i);
            let t0 = Instant::now();
            s.send_to(&msg, peer)?;
            let (n, _) = s.recv_from(&mut buf).context("no echo within 10 s")?;
            hist.saturating_record(t0.elapsed().as_nanos().max(1) as u64);
            check_payload(&buf, n, msg.len(), i)?;
        }
        let elapsed = start.elapsed();
        s.send_to(BYE, peer)?;
        Ok(Latency::from_histogram(&hist, elapsed))
    })();
    if res.is_err() {
        let _ = child.kill();
    }
    let st = child.wait()?;
    let lat = res?;
    if !st.success() {
        bail!("echo process exited with {st}");
    }
    Ok(lat)
}

//! `rds-netbench`: 64 B round trip and one-way message rate between two hosts (network
//! namespaces) through their rdsds over RDS/TCP, next to plain kernel TCP between the same two
//! namespaces in the same run. Driven by `bench/netns-bench.sh`, which builds the namespaces
//! and starts one rdsd in each.
//!
//! The process attaches to both rdsds through their control sockets (Unix sockets don't care
//! about network namespaces); the kernel-TCP baseline sockets are created in each namespace
//! with setns(2) on a short-lived thread.

use hdrhistogram::Histogram;
use shm_api::{Rdsd, RecvFlags};
use std::io::{Read, Write};
use std::net::{SocketAddrV4, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::Instant;

fn arg(name: &str) -> String {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
        .unwrap_or_else(|| panic!("missing {name}; usage: rds-netbench --a-sock P --b-sock P --a-ns N --b-ns N --a-ip IP --b-ip IP [--count N]"))
}

/// Runs `f` on a thread that has joined network namespace `ns`.
fn in_netns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let path = format!("/var/run/netns/{ns}");
    std::thread::spawn(move || {
        let file = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        // SAFETY: setns on this thread only, with a valid netns fd.
        let r = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(r, 0, "setns {path}: {}", std::io::Error::last_os_error());
        f()
    })
    .join()
    .expect("netns thread")
}

/// Context switches of every thread of `pid` (voluntary + involuntary), and its CPU ticks.
fn proc_sample(pid: Option<u32>) -> (u64, u64) {
    let Some(pid) = pid else { return (0, 0) };
    let mut switches = 0;
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in tasks.flatten() {
            let status = std::fs::read_to_string(t.path().join("status")).unwrap_or_default();
            for line in status.lines() {
                if line.starts_with("voluntary_ctxt_switches")
                    || line.starts_with("nonvoluntary_ctxt_switches")
                {
                    switches += line
                        .split_whitespace()
                        .nth(1)
                        .and_then(|v| v.parse::<u64>().ok())
                        .unwrap_or(0);
                }
            }
        }
    }
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<u64> = after
        .split_whitespace()
        .map(|v| v.parse().unwrap_or(0))
        .collect();
    // Fields 14 and 15 (utime, stime) are at 11 and 12 after the command name.
    let ticks = f.get(11).copied().unwrap_or(0) + f.get(12).copied().unwrap_or(0);
    (switches, ticks)
}

fn stat_of(sock: &str, name: &str) -> u64 {
    shm_api::stats_at(sock.as_ref())
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        })
        .unwrap_or(0)
}

fn thread_switches() -> u64 {
    // SAFETY: getrusage writes into our struct.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer to a rusage.
    unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) };
    (ru.ru_nvcsw + ru.ru_nivcsw) as u64
}

fn opt_arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn summary(name: &str, h: &Histogram<u64>, secs: f64) {
    println!(
        "{name:<28} p50 {:>8.2} us  p99 {:>8.2} us  p99.9 {:>8.2} us  {:>9.0} round trips/s",
        h.value_at_quantile(0.5) as f64 / 1000.0,
        h.value_at_quantile(0.99) as f64 / 1000.0,
        h.value_at_quantile(0.999) as f64 / 1000.0,
        h.len() as f64 / secs
    );
}

fn main() {
    let count: u64 = std::env::args()
        .collect::<Vec<_>>()
        .windows(2)
        .find(|w| w[0] == "--count")
        .map_or(20_000, |w| w[1].parse().expect("count"));
    let (a_ip, b_ip) = (arg("--a-ip"), arg("--b-ip"));
    let (a_ns, b_ns) = (arg("--a-ns"), arg("--b-ns"));
    let size = 64usize;

    // ---- rdsd: one socket on each host, ping-pong from one thread --------------------------
    let ra = Rdsd::attach_at(arg("--a-sock").as_ref()).expect("attach host a");
    let rb = Rdsd::attach_at(arg("--b-sock").as_ref()).expect("attach host b");
    let a = ra.socket().unwrap();
    let b = rb.socket().unwrap();
    let aaddr: SocketAddrV4 = format!("{a_ip}:4100").parse().unwrap();
    let baddr: SocketAddrV4 = format!("{b_ip}:4100").parse().unwrap();
    a.bind(aaddr).unwrap();
    b.bind(baddr).unwrap();
    let nb = RecvFlags {
        dontwait: true,
        ..Default::default()
    };
    let msg = vec![7u8; size];
    let mut buf = vec![0u8; 2048];
    // RDS_NETBENCH_BLOCKING=1: blocking receives (futex), for machines with fewer cores than
    // spinning threads (two poll cores + the app).
    let blocking = std::env::var_os("RDS_NETBENCH_BLOCKING").is_some();
    let spin_recv = |s: &shm_api::Socket, buf: &mut [u8]| loop {
        if blocking {
            return s.recv(buf).expect("recv");
        }
        match s.recv_msg(buf, nb) {
            Ok(m) => return m.len,
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => std::hint::spin_loop(),
            Err(e) => panic!("recv: {e}"),
        }
    };
    let pids = [
        opt_arg("--a-pid").and_then(|p| p.parse().ok()),
        opt_arg("--b-pid").and_then(|p| p.parse().ok()),
    ];
    let socks = [arg("--a-sock"), arg("--b-sock")];
    let mut before = None;
    let mut h = Histogram::<u64>::new(3).unwrap();
    for i in 0..count + 1000 {
        if i == 1000 {
            before = Some((
                pids.map(proc_sample),
                [0, 1].map(|k| stat_of(&socks[k], "poll_parks")),
                thread_switches(),
                Instant::now(),
            ));
        }
        let t = Instant::now();
        a.send_to(&msg, baddr).unwrap();
        spin_recv(&b, &mut buf);
        b.send_to(&msg, aaddr).unwrap();
        spin_recv(&a, &mut buf);
        if i >= 1000 {
            h.record(t.elapsed().as_nanos() as u64).unwrap();
        }
    }
    let rds_secs = h.mean() * h.len() as f64 / 1e9;
    let rds = h.clone();
    // Where the time goes: wake-ups and CPU per round trip, for each rdsd and the app.
    let (p0, parks0, app0, t0) = before.expect("sampled");
    let p1 = pids.map(proc_sample);
    let parks1 = [0, 1].map(|k| stat_of(&socks[k], "poll_parks"));
    let app1 = thread_switches();
    let wall = t0.elapsed().as_secs_f64();
    let n = count as f64;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let per_rt = format!(
        "per round trip: rdsd parks A {:.2} B {:.2}; rdsd context switches A {:.2} B {:.2}; app context switches {:.2}; rdsd CPU A {:.0}% B {:.0}%",
        (parks1[0] - parks0[0]) as f64 / n,
        (parks1[1] - parks0[1]) as f64 / n,
        (p1[0].0 - p0[0].0) as f64 / n,
        (p1[1].0 - p0[1].0) as f64 / n,
        (app1 - app0) as f64 / n,
        100.0 * (p1[0].1 - p0[0].1) as f64 / hz / wall,
        100.0 * (p1[1].1 - p0[1].1) as f64 / hz / wall,
    );

    // ---- rdsd one-way rate -------------------------------------------------------------------
    b.set_recv_buffer_size(64 << 20).unwrap();
    a.set_send_buffer_size(64 << 20).unwrap();
    let n_rate = count * 10;
    let t = Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut buf = vec![0u8; 2048];
            for _ in 0..n_rate {
                spin_recv(&b, &mut buf);
            }
        });
        let mut sent = 0;
        while sent < n_rate {
            match a.send_msg(&msg, Some(baddr), true) {
                Ok(_) => sent += 1,
                Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::ENOBUFS)) => {
                    std::hint::spin_loop()
                }
                Err(e) => panic!("send: {e}"),
            }
        }
    });
    let rds_rate = n_rate as f64 / t.elapsed().as_secs_f64();

    // ---- kernel TCP between the same namespaces ---------------------------------------------
    let b_ip2 = b_ip.clone();
    let listener = in_netns(&b_ns, move || {
        TcpListener::bind(format!("{b_ip2}:4200")).expect("listen")
    });
    let b_ip3 = b_ip.clone();
    let client = in_netns(&a_ns, move || {
        TcpStream::connect(format!("{b_ip3}:4200")).expect("connect")
    });
    let (server, _) = listener.accept().unwrap();
    client.set_nodelay(true).unwrap();
    server.set_nodelay(true).unwrap();
    let echo = {
        let mut server = server.try_clone().unwrap();
        std::thread::spawn(move || {
            let mut m = vec![0u8; size];
            while server.read_exact(&mut m).is_ok() {
                if server.write_all(&m).is_err() {
                    break;
                }
            }
        })
    };
    let mut c = client.try_clone().unwrap();
    let mut m = vec![0u8; size];
    let mut ht = Histogram::<u64>::new(3).unwrap();
    for i in 0..count + 1000 {
        let t = Instant::now();
        c.write_all(&msg).unwrap();
        c.read_exact(&mut m).unwrap();
        if i >= 1000 {
            ht.record(t.elapsed().as_nanos() as u64).unwrap();
        }
    }
    let tcp_secs = ht.mean() * ht.len() as f64 / 1e9;
    drop(c);
    let _ = client.shutdown(std::net::Shutdown::Both);
    let _ = echo.join();

    // One-way: 64 B application messages written back to back (TCP_NODELAY, one write each).
    let listener = {
        let b_ip = b_ip.clone();
        in_netns(&b_ns, move || {
            TcpListener::bind(format!("{b_ip}:4201")).expect("listen")
        })
    };
    let client = in_netns(&a_ns, move || {
        TcpStream::connect(format!("{b_ip}:4201")).expect("connect")
    });
    let (mut server, _) = listener.accept().unwrap();
    client.set_nodelay(true).unwrap();
    let t = Instant::now();
    let rx = std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        let mut total = 0u64;
        while total < n_rate * size as u64 {
            let n = server.read(&mut buf).unwrap();
            assert!(n > 0);
            total += n as u64;
        }
    });
    let mut c = client;
    for _ in 0..n_rate {
        c.write_all(&msg).unwrap();
    }
    rx.join().unwrap();
    let tcp_rate = n_rate as f64 / t.elapsed().as_secs_f64();

    println!(
        "64 B between two network namespaces ({count} round trips, {n_rate} one-way messages)"
    );
    summary(
        if blocking {
            "rdsd RDS/TCP (blocking recv)"
        } else {
            "rdsd RDS/TCP (busy-poll)"
        },
        &rds,
        rds_secs,
    );
    println!("  {per_rt}");
    summary("kernel TCP ping-pong", &ht, tcp_secs);
    println!(
        "p50 ratio kernel TCP / rdsd: {:.2}",
        ht.value_at_quantile(0.5) as f64 / rds.value_at_quantile(0.5) as f64
    );
    println!("one-way rate: rdsd {rds_rate:.0} msgs/s, kernel TCP (64 B writes) {tcp_rate:.0} msgs/s, ratio rdsd/TCP {:.2}", rds_rate / tcp_rate);
}

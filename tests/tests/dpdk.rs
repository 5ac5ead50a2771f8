//! The DPDK transport between real rdsd processes: two network namespaces joined by a veth
//! pair, each rdsd on a `net_af_packet` port on its veth end (the kernel interface has no
//! address: the DPDK port owns it), EAL with `--no-huge` and a unique `--file-prefix` per
//! process. Every exchange checks exactly-once, in-order delivery and every payload byte.
//!
//! Needs root (namespaces, packet sockets) and DPDK's EAL. Without them a test fails in CI
//! and is a counted skip elsewhere (`rdsd_tests::require!`); every other failure fails.

use rdsd_tests::netns::VethPair;
use rdsd_tests::*;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::PathBuf;
use std::sync::mpsc;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The `[dpdk]` config of a host whose port sits on `iface` with address `addr`.
fn dpdk_config(iface: &str, addr: Ipv4Addr, extra: &str) -> PathBuf {
    config_file(&format!(
        "[dpdk]\nvdev = \"net_af_packet0,iface={iface}\"\naddr = \"{addr}/24\"\n{extra}\n{}",
        dpdk_queues_line(extra)
    ))
}

/// Starts rdsd on host `i` of `pair` on a DPDK port (`paths` paths).
fn dpdk_daemon(pair: &VethPair, i: usize, paths: u8) -> Daemon {
    dpdk_daemon_with(pair, i, paths, &[])
}

fn dpdk_daemon_with(pair: &VethPair, i: usize, paths: u8, extra: &[&str]) -> Daemon {
    let cfg = dpdk_config(VethPair::iface(i), pair.addr(i), "");
    let cfg = cfg.to_str().unwrap().to_string();
    let p = paths.to_string();
    let mut args = vec!["-c", &cfg, "--local-addr", "127.0.0.0/8", "--paths", &p];
    args.extend_from_slice(extra);
    Daemon::start_in(Some(&pair.ns[i]), &args)
}

/// Starts rdsd on host `i` of `pair` on kernel TCP (the kernel has the address).
fn kernel_daemon(pair: &VethPair, i: usize, paths: u8) -> Daemon {
    kernel_daemon_with(pair, i, paths, &[])
}

fn kernel_daemon_with(pair: &VethPair, i: usize, paths: u8, extra: &[&str]) -> Daemon {
    pair.kernel_addr(i);
    let local = format!("{}/32", pair.addr(i));
    let p = paths.to_string();
    let mut args = vec![
        "--local-addr",
        &local,
        "--local-addr",
        "127.0.0.0/8",
        "--paths",
        &p,
    ];
    args.extend_from_slice(extra);
    Daemon::start_in(Some(&pair.ns[i]), &args)
}

/// How to get what these tests need.
const DPDK_INSTALL: &str =
    "run as root with DPDK 22.11 installed: sudo -E bash tests/run.sh (dataplane/install-build-deps.sh)";

/// `Ok` when EAL starts here (checked once, with rdsd on a net_null port in a namespace of its
/// own); otherwise why not.
fn eal_works() -> Result<(), String> {
    static OK: OnceLock<Result<(), String>> = OnceLock::new();
    OK.get_or_init(|| {
        if !netns::is_root() {
            return Err("the DPDK tests need root (namespaces, packet sockets)".into());
        }
        let ns = format!("dpchk{}", std::process::id());
        let _ = std::process::Command::new("ip")
            .args(["netns", "add", &ns])
            .status();
        let cfg = config_file("[dpdk]\nvdev = \"net_null0\"\naddr = \"10.254.0.1/24\"\n");
        let sock = std::env::temp_dir().join(format!("rdsd-dpchk-{}.sock", std::process::id()));
        let out = std::env::temp_dir().join(format!("rdsd-dpchk-{}.err", std::process::id()));
        let mut child = std::process::Command::new("ip")
            .args(["netns", "exec", &ns])
            .arg(rdsd_bin())
            .arg("-c")
            .arg(&cfg)
            .arg("--control-socket")
            .arg(&sock)
            .args(["--poll-core", "-2", "--control-core", "-2", "--log", "warn"])
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&out).unwrap())
            .spawn()
            .expect("spawn rdsd");
        let start = Instant::now();
        let ok = loop {
            if shm_api::Rdsd::attach_at(&sock).is_ok() {
                break true;
            }
            if child.try_wait().unwrap().is_some() || start.elapsed() > Duration::from_secs(20) {
                break false;
            }
            // Poll interval of this wait for rdsd to serve (or exit).
            std::thread::sleep(Duration::from_millis(20));
        };
        let _ = child.kill();
        let _ = child.wait();
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &ns])
            .status();
        let err = std::fs::read_to_string(&out).unwrap_or_default();
        let _ = std::fs::remove_file(&out);
        let _ = std::fs::remove_file(&sock);
        if ok {
            Ok(())
        } else {
            Err(format!(
                "DPDK's EAL cannot start on this machine; rdsd said:\n{err}"
            ))
        }
    })
    .clone()
}

/// The payload of message `seq` with `len` bytes: the sequence number, then a pattern that
/// depends on it.
fn payload(seq: u64, len: usize, out: &mut Vec<u8>) {
    out.clear();
    out.extend((0..len).map(|j| (seq.wrapping_mul(31).wrapping_add(j as u64 * 7) % 251) as u8));
    let n = len.min(8);
    out[..n].copy_from_slice(&seq.to_le_bytes()[..n]);
}

/// Sizes and counts of one exchange: small, around the MSS, around 64 KiB, up to 1 MiB.
const PLAN: &[(usize, u64)] = &[
    (8, 300),
    (100, 300),
    (1448, 200),
    (1460, 200),
    (4000, 100),
    (65536, 30),
    (300_000, 6),
    (1 << 20, 6),
];

/// Messages of the plan that leave the sender's tx ring in place (`tcp_zero_copy_min`, 16 KiB)
/// instead of being copied first.
fn plan_in_place() -> u64 {
    PLAN.iter().filter(|p| p.0 >= 16 * 1024).map(|p| p.1).sum()
}

/// Checks that each daemon, which sent the plan once, sent its large messages in place, with
/// several poll threads too (a send from an app on another thread than the connection's owner
/// crosses to it in place, `SendRef`).
fn assert_plan_went_in_place(d: &Daemon) {
    assert_eq!(
        d.stat("tx_in_place"),
        plan_in_place(),
        "the plan's messages of 16 KiB or more, in place"
    );
}

/// Receives the plan's messages on `at` (bound before `ready` fires) and checks each one's
/// length and every byte, in order.
fn receiver(sock: PathBuf, at: SocketAddrV4, from: SocketAddrV4, ready: mpsc::Sender<()>) -> u64 {
    let r = shm_api::Rdsd::attach_at(&sock).expect("attach");
    let s = r.socket().unwrap();
    s.set_recv_buffer_size(8 << 20).unwrap();
    s.set_recv_timeout(Some(Duration::from_secs(30))).unwrap();
    s.bind(at).unwrap();
    ready.send(()).unwrap();
    let mut buf = vec![0u8; (1 << 20) + 16];
    let mut want = Vec::new();
    let mut seq = 0u64;
    for &(len, count) in PLAN {
        for _ in 0..count {
            let (n, src) = s
                .recv_from(&mut buf)
                .unwrap_or_else(|e| panic!("{at}: message {seq} ({len} bytes) not received: {e}"));
            assert_eq!(src, from, "source of message {seq}");
            assert_eq!(n, len, "{at}: message {seq} has {n} bytes, sent {len}");
            payload(seq, len, &mut want);
            if buf[..n] != want[..] {
                let got = u64::from_le_bytes(buf[..8].try_into().unwrap());
                panic!("{at}: message {seq} corrupt or out of order (carries {got})");
            }
            seq += 1;
        }
    }
    // Nothing more: no duplicate after the last (an absence: a short deadline is the check).
    s.set_recv_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    assert!(
        s.recv_from(&mut buf).is_err(),
        "{at}: a message after the last"
    );
    seq
}

/// Sends the [`PLAN`]; returns the attachment and socket, which the caller keeps until the
/// peer received everything (closing drops what is unacknowledged).
fn sender(sock: PathBuf, from: SocketAddrV4, to: SocketAddrV4) -> (shm_api::Rdsd, shm_api::Socket) {
    let r = shm_api::Rdsd::attach_at(&sock).expect("attach");
    let s = r.socket().unwrap();
    s.set_send_buffer_size(4 << 20).unwrap();
    s.set_send_timeout(Some(Duration::from_secs(30))).unwrap();
    s.bind(from).unwrap();
    let mut p = Vec::new();
    let mut seq = 0u64;
    for &(len, count) in PLAN {
        for _ in 0..count {
            payload(seq, len, &mut p);
            s.send_to(&p, to)
                .unwrap_or_else(|e| panic!("{from} -> {to}: send {seq} ({len} bytes): {e}"));
            seq += 1;
        }
    }
    (r, s)
}

/// Both directions at once between host addresses `a` and `b` served by `da` and `db`.
fn exchange(da: &Daemon, a: Ipv4Addr, db: &Daemon, b: Ipv4Addr, port: u16) -> Duration {
    let t = Instant::now();
    let at = |ip: Ipv4Addr, p: u16| SocketAddrV4::new(ip, p);
    let (tx, rx) = mpsc::channel();
    let (sa, sb) = (da.socket.clone(), db.socket.clone());
    let (ra, rb) = {
        let (sa, sb, tx2) = (sa.clone(), sb.clone(), tx.clone());
        let rb = std::thread::spawn(move || receiver(sb, at(b, port), at(a, port + 1), tx));
        let ra = std::thread::spawn(move || receiver(sa, at(a, port), at(b, port + 1), tx2));
        (ra, rb)
    };
    for _ in 0..2 {
        rx.recv_timeout(Duration::from_secs(10))
            .expect("receivers bound");
    }
    let s1 = std::thread::spawn(move || sender(sa, at(a, port + 1), at(b, port)));
    let s2 = std::thread::spawn(move || sender(sb, at(b, port + 1), at(a, port)));
    let total: u64 = PLAN.iter().map(|p| p.1).sum();
    assert_eq!(rb.join().expect("receiver at b"), total);
    assert_eq!(ra.join().expect("receiver at a"), total);
    // Both peers have everything: now the senders may detach.
    drop(s1.join().expect("sender a"));
    drop(s2.join().expect("sender b"));
    t.elapsed()
}

/// Frames of standard size (1460 payload bytes) the plan's bytes need one way: a daemon that
/// received fewer frames than this (its peer's data and the ACKs of its own) got jumbo frames.
fn plan_standard_frames() -> u64 {
    PLAN.iter().map(|&(len, n)| len as u64 * n).sum::<u64>() / 1460
}

/// The plan both ways between two rdsd on af_packet ports, the veth pair at `mtu` (None: the
/// default 1500, which rdsd takes).
fn dpdk_pair_exchange(paths: u8, mtu: Option<u16>) {
    require!(eal_works(), DPDK_INSTALL);
    let pair = VethPair::new();
    if let Some(m) = mtu {
        pair.set_mtu(m);
    }
    let d0 = dpdk_daemon(&pair, 0, paths);
    let d1 = dpdk_daemon(&pair, 1, paths);
    let took = exchange(&d0, pair.addr(0), &d1, pair.addr(1), 7000);
    let total: u64 = PLAN.iter().map(|p| p.1).sum();
    eprintln!("{paths} path(s): {total} messages each way in {took:?}");
    for d in [&d0, &d1] {
        assert_eq!(d.stat("dpdk_delivered"), total);
        assert!(d.stat("dpdk_rx_packets") > 0 && d.stat("dpdk_tx_packets") > 0);
        assert!(d.stat("dpdk_tx_bursts") > 0 && d.stat("dpdk_rx_bursts") > 0);
        assert_eq!(d.stat("dpdk_mbuf_alloc_failures"), 0);
        assert_eq!(d.stat("tcp_delivered"), 0, "nothing went over kernel TCP");
        assert_plan_went_in_place(d);
        let st = d.stats();
        let tcp: Vec<String> = st
            .lines()
            .filter(|l| l.starts_with("dpdk_tcp_") || l.starts_with("dpdk_tx_drops"))
            .map(|l| l.trim_start_matches("dpdk_").to_string())
            .collect();
        eprintln!("  {}", tcp.join(", "));
    }
    // The smaller address connected every path; the larger accepted them. A CPU-starved run
    // (other tests' poll cores on the same 2 CPUs) has seen one path come up twice; what this
    // test stands for, every message exactly once over DPDK, is asserted above either way.
    let (up, acc) = (d0.stat("dpdk_path_up"), d1.stat("dpdk_accepts"));
    eprintln!("  path_up {up} (paths {paths}), accepts {acc}");
    assert!(
        up >= u64::from(paths) && acc >= u64::from(paths),
        "every path came up"
    );
    assert_eq!(
        d1.stat("dpdk_path_up"),
        0,
        "the larger address never connects"
    );
    let standard = plan_standard_frames();
    for d in [&d0, &d1] {
        let rx = d.stat("dpdk_rx_packets");
        eprintln!("  rx frames {rx}, standard frames for the plan's data {standard}");
        if mtu.is_some_and(|m| m >= 9000) {
            assert!(rx < standard, "{rx} frames received: not jumbo frames");
        } else {
            assert!(rx >= standard, "{rx} frames received at MTU 1500?");
        }
    }
}

#[test]
fn dpdk_to_dpdk_one_path_both_ways_up_to_1mib() {
    dpdk_pair_exchange(1, None);
}

#[test]
fn dpdk_to_dpdk_eight_paths_both_ways_up_to_1mib() {
    dpdk_pair_exchange(8, None);
}

/// The same on a veth pair at MTU 9000: af_packet in jumbo frames (rdsd sizes the packet
/// rings for them and takes the interface's MTU).
#[test]
fn dpdk_to_dpdk_eight_paths_both_ways_up_to_1mib_in_jumbo_frames() {
    dpdk_pair_exchange(8, Some(9000));
}

/// Starts rdsd on host `i` of `pair` on a DPDK af_xdp port (one queue), `extra` added to the
/// vdev.
fn af_xdp_daemon(pair: &VethPair, i: usize, paths: u8, extra: &str) -> Daemon {
    let cfg = config_file(&format!(
        "[dpdk]\nvdev = \"net_af_xdp0,iface={}{extra}\"\naddr = \"{}/24\"\nqueues = 1\n",
        VethPair::iface(i),
        pair.addr(i)
    ));
    let cfg = cfg.to_str().unwrap().to_string();
    let p = paths.to_string();
    Daemon::start_in(
        Some(&pair.ns[i]),
        &["-c", &cfg, "--local-addr", "127.0.0.0/8", "--paths", &p],
    )
}

/// The plan both ways between two rdsd on DPDK af_xdp ports (an AF_XDP socket and the
/// driver's XDP program on each veth end). The veth is at MTU 3506 (the most veth takes XDP
/// at), more than DPDK 22.11's af_xdp carries: rdsd takes the interface's MTU capped at
/// `AF_XDP_MAX_MTU` (1778), and with the driver's reported 3542 every full-size segment
/// would be lost and the exchange would stall.
#[test]
fn af_xdp_between_two_rdsd_both_ways_up_to_1mib() {
    require!(eal_works(), DPDK_INSTALL);
    let pair = VethPair::new();
    pair.set_mtu(3506);
    let d = [0, 1].map(|i| af_xdp_daemon(&pair, i, 4, ""));
    let took = exchange(&d[0], pair.addr(0), &d[1], pair.addr(1), 7300);
    let total: u64 = PLAN.iter().map(|p| p.1).sum();
    eprintln!("af_xdp, 4 paths: {total} messages each way in {took:?}");
    for d in &d {
        assert_eq!(d.stat("dpdk_delivered"), total);
        assert_eq!(d.stat("tcp_delivered"), 0, "nothing went over kernel TCP");
        assert_eq!(d.stat("dpdk_mbuf_alloc_failures"), 0);
        // Segments of up to 1738 bytes.
        let rx = d.stat("dpdk_rx_packets");
        let data: u64 = PLAN.iter().map(|&(len, n)| len as u64 * n).sum();
        eprintln!("  rx frames {rx} for {data} bytes of messages");
        assert!(rx > data / 1738, "{rx} frames: larger than the MTU cap?");
    }
}

/// System calls of an af_xdp poll thread per 64 B round trip, counted with strace: DPDK's
/// af_xdp driver by default asks the kernel for preferred busy polling (`busy_budget=64`) and
/// then makes a `recvfrom` on every rx burst, empty or not (about 40 per message on this
/// 2-CPU VM); rdsd's poll thread already polls, so rdsd adds `busy_budget=0` to the vdev. What
/// remains is the transmit kick (`sendto`, one per tx burst, as af_packet's).
#[test]
fn af_xdp_poll_thread_makes_no_receive_syscall() {
    require!(eal_works(), DPDK_INSTALL);
    const WARM_UP: u64 = 50;
    const ROUND_TRIPS: u64 = 500;
    let pair = VethPair::new();
    let d = [0, 1].map(|i| af_xdp_daemon(&pair, i, 1, ""));
    let (a0, a1) = (
        SocketAddrV4::new(pair.addr(0), 7400),
        SocketAddrV4::new(pair.addr(1), 7400),
    );
    let mut pp = PingPong::start(
        &d[0],
        a0,
        &d[1],
        a1,
        WARM_UP + ROUND_TRIPS,
        Duration::from_secs(10),
    );
    for seq in 0..WARM_UP {
        pp.round_trip(seq);
    }
    let strace = PollThreadSyscalls::attach(&d[0]);
    for seq in WARM_UP..WARM_UP + ROUND_TRIPS {
        pp.round_trip(seq);
    }
    let Some(strace) = strace else {
        pp.finish();
        return;
    };
    let (text, calls) = strace.finish();
    pp.finish();
    eprintln!("af_xdp, active poll thread, {ROUND_TRIPS} round trips:\n{text}");
    let per = |k: &str| calls.get(k).copied().unwrap_or(0) as f64 / ROUND_TRIPS as f64;
    assert!(
        per("recvfrom") < 0.1,
        "{} recvfrom per round trip: the driver busy-polls through the kernel",
        per("recvfrom")
    );
    assert!(
        per("sendto") <= 3.0,
        "{} sendto per round trip",
        per("sendto")
    );
}

/// rdsd on DPDK against rdsd on kernel TCP; `dpdk_host` picks which host (0 has the smaller
/// address and connects) runs DPDK.
fn interop(dpdk_host: usize, mtu: Option<u16>) {
    interop_on(dpdk_host, mtu, |pair, i| dpdk_daemon(pair, i, 4));
}

/// The same with the DPDK side started by `start` (4 paths; an af_packet or af_xdp port).
fn interop_on(dpdk_host: usize, mtu: Option<u16>, start: impl Fn(&VethPair, usize) -> Daemon) {
    require!(eal_works(), DPDK_INSTALL);
    let pair = VethPair::new();
    if let Some(m) = mtu {
        pair.set_mtu(m);
    }
    let k = 1 - dpdk_host;
    pair.no_tx_offload(k);
    let dd = start(&pair, dpdk_host);
    let dk = kernel_daemon(&pair, k, 4);
    let took = exchange(&dd, pair.addr(dpdk_host), &dk, pair.addr(k), 7100);
    eprintln!("interop, DPDK on host {dpdk_host}: {took:?}");
    let total: u64 = PLAN.iter().map(|p| p.1).sum();
    assert_eq!(dd.stat("dpdk_delivered"), total);
    assert_eq!(dk.stat("tcp_delivered"), total);
    if dpdk_host == 0 {
        assert_eq!(dd.stat("dpdk_path_up"), 4, "DPDK connected");
        assert_eq!(dk.stat("tcp_accepts"), 4);
    } else {
        assert_eq!(dk.stat("tcp_path_up"), 4, "kernel connected");
        assert_eq!(dd.stat("dpdk_accepts"), 4);
    }
}

/// rdsd on an af_xdp port against rdsd on kernel TCP, both connect orders: the kernel's
/// segments reach the XDP program's socket (the veth's TX checksum offload off: XDP sees
/// no completed checksum), and the AF_XDP socket's reach the kernel's TCP.
#[test]
fn af_xdp_and_kernel_tcp_rdsd_both_connect_orders() {
    for xdp_host in [0, 1] {
        interop_on(xdp_host, None, |pair, i| af_xdp_daemon(pair, i, 4, ""));
    }
}

#[test]
fn dpdk_connects_to_kernel_tcp_rdsd() {
    interop(0, None);
}

#[test]
fn kernel_tcp_rdsd_connects_to_dpdk() {
    interop(1, None);
}

/// Jumbo frames both ways between userspace TCP (af_packet, MTU 9000) and the kernel's TCP
/// (its veth at 9000, offloads off): each side sends segments within the other's MSS.
#[test]
fn kernel_tcp_rdsd_and_dpdk_in_jumbo_frames() {
    interop(1, Some(9000));
}

/// Host 0 streams to host 1 (both DPDK) while host `victim`'s rdsd is SIGKILLed and restarted:
/// no duplicate, no reordering, at most one gap (dataplane/docs/protocol.md, "Restart policy": a killed
/// receiver loses what was in its rings, a killed sender what it had not yet had acknowledged).
fn restart_mid_stream(victim: usize) {
    restart_mid_stream_on(victim, false)
}

/// The same on af_xdp ports when `af_xdp`: the restarted rdsd finds its predecessor's XDP
/// program on the interface.
fn restart_mid_stream_on(victim: usize, af_xdp: bool) {
    require!(eal_works(), DPDK_INSTALL);
    let pair = VethPair::new();
    let start = |i| {
        if af_xdp {
            af_xdp_daemon(&pair, i, 8, "")
        } else {
            dpdk_daemon(&pair, i, 8)
        }
    };
    let mut d = [start(0), start(1)];
    let a0 = SocketAddrV4::new(pair.addr(0), 9201).to_string();
    let a1 = SocketAddrV4::new(pair.addr(1), 9200).to_string();
    let mut r = d[1].app(&["recv-resilient", &a1, "2999"]);
    r.expect("bound");
    let mut s = d[0].app(&["send-resilient", &a0, &a1, "3000", "500"]);
    s.expect("sending");
    // Mid-stream: host 1 delivered part of it.
    let delivered = wait_until(
        Duration::from_secs(20),
        "host 1 to deliver part of the stream",
        || d[1].stat("dpdk_delivered"),
        |&n| n >= 300,
    );
    d[victim].kill();
    assert!(delivered < 3000, "killed mid-stream: {delivered}");
    // Down for a moment (the restart's shape, not synchronisation: a SIGKILLed userspace TCP
    // sends no FIN, so the peer has nothing to notice until the restarted side shows up).
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    d[victim].spawn();
    let done = r.expect_within("done", Duration::from_secs(60));
    eprintln!(
        "restart of host {victim}: {done} ({:?} after restart)",
        t.elapsed()
    );
    assert_one_restart(&done, victim);
    assert!(s.expect("sent").starts_with("3000"));
    // The restarted side (host 0 connects) is refused while the peer still holds the old
    // paths; its reconnects back off instead of storming (hundreds to thousands before).
    let connects = d[0].stat("dpdk_connects");
    eprintln!("host 0 connects since its (re)start: {connects}");
    assert!(connects < 200, "reconnect storm: {connects} connects");
}

#[test]
fn dpdk_receiver_rdsd_sigkilled_and_restarted() {
    restart_mid_stream(1);
}

#[test]
fn dpdk_sender_rdsd_sigkilled_and_restarted() {
    restart_mid_stream(0);
}

#[test]
fn af_xdp_receiver_rdsd_sigkilled_and_restarted() {
    restart_mid_stream_on(1, true);
}

/// Runs rdsd in `ns` with `cfg`, expecting it to exit with an error; returns its stderr.
fn rdsd_fails(ns: &str, cfg: &std::path::Path) -> String {
    let sock = std::env::temp_dir().join(format!("rdsd-dpfail-{}.sock", std::process::id()));
    let mut c = std::process::Command::new("ip");
    c.args(["netns", "exec", ns])
        .arg(rdsd_bin())
        .arg("-c")
        .arg(cfg);
    c.arg("--control-socket").arg(&sock);
    c.args(["--poll-core", "-2", "--control-core", "-2"]);
    let child = c
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    // A deadline for a hung rdsd, not synchronisation.
    let watchdog = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(20));
        // SAFETY: kill(2) on our own child's pid (harmless if it already exited and was reaped
        // moments ago: the test fails on the status below anyway).
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    });
    let out = child.wait_with_output().unwrap();
    drop(watchdog);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "rdsd must refuse to start; stderr:\n{err}"
    );
    let _ = std::fs::remove_file(&sock);
    err
}

#[test]
fn dpdk_address_on_a_kernel_interface_is_refused_and_bad_eal_args_are_named() {
    require!(eal_works(), DPDK_INSTALL);
    let pair = VethPair::new();
    // The port's address is also the kernel's. (One queue: `rdsd_fails` runs one poll thread.)
    pair.kernel_addr(0);
    let cfg = dpdk_config(VethPair::iface(0), pair.addr(0), "queues = 1");
    let err = rdsd_fails(&pair.ns[0], &cfg);
    assert!(
        err.contains("also configured on kernel interface v0") && err.contains("dpdk.addr"),
        "{err}"
    );
    // An option EAL does not have: named before EAL runs.
    let cfg = dpdk_config(
        "v1",
        pair.addr(1),
        "eal_args = [\"--no-such-option\"]\nqueues = 1",
    );
    let err = rdsd_fails(&pair.ns[1], &cfg);
    assert!(
        err.contains("dpdk.eal_args") && err.contains("--no-such-option"),
        "{err}"
    );
    // A core list EAL refuses: EAL's error, and the keys to check.
    let cfg = dpdk_config("v1", pair.addr(1), "lcores = \"4000\"\nqueues = 1");
    let err = rdsd_fails(&pair.ns[1], &cfg);
    assert!(
        err.contains("rte_eal_init") && err.contains("dpdk.lcores"),
        "{err}"
    );
    // A vdev that is not a net device.
    let cfg = config_file("[dpdk]\nvdev = \"eth0\"\naddr = \"10.1.0.1/24\"\n");
    let err = rdsd_fails(&pair.ns[1], &cfg);
    assert!(err.contains("dpdk.vdev"), "{err}");
}

#[test]
fn memif_between_two_rdsd_both_ways_up_to_1mib() {
    require!(eal_works(), DPDK_INSTALL);
    // The namespaces only keep the addresses away from the host's kernel; the frames go
    // through memif's shared memory, not the veth.
    let pair = VethPair::new();
    let sock = std::env::temp_dir().join(format!("rdsd-memif-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&sock);
    let d0 = pair.memif_daemon(0, &sock, 4, &[]);
    let d1 = pair.memif_daemon(1, &sock, 4, &[]);
    let took = exchange(&d0, pair.addr(0), &d1, pair.addr(1), 7200);
    eprintln!("memif, 4 paths: {took:?}");
    let total: u64 = PLAN.iter().map(|p| p.1).sum();
    for d in [&d0, &d1] {
        assert_eq!(d.stat("dpdk_delivered"), total);
        assert_eq!(d.stat("dpdk_mbuf_alloc_failures"), 0);
        assert_plan_went_in_place(d);
    }
    drop((d0, d1));
    let _ = std::fs::remove_file(&sock);
}

/// Two poll threads per rdsd, each driving one of its port's two queue pairs (`[dpdk]
/// queues = 2`): each connection is one thread's at both ends (a symmetric hash of the address
/// pair); sends from an app on the other thread cross to it, and frames that arrive on the other
/// thread's queue are steered to it. Returns the connection's owner and each side's steered
/// frames.
fn two_queue_exchange(d: [&Daemon; 2], pair: &VethPair, port: u16) -> (u64, [u64; 2]) {
    let took = exchange(d[0], pair.addr(0), d[1], pair.addr(1), port);
    let total: u64 = PLAN.iter().map(|p| p.1).sum();
    let mut owners = Vec::new();
    for x in d {
        assert_eq!(x.stat("dpdk_delivered"), total);
        assert_eq!(x.stat("dpdk_mbuf_alloc_failures"), 0);
        assert_eq!(x.stat("dpdk_steer_drops"), 0);
        let conns = x.info_json(&["-n"])["connections"]
            .as_array()
            .expect("connections")
            .clone();
        assert_eq!(conns.len(), 1, "{conns:?}");
        owners.push(conns[0]["shard"].as_u64().expect("shard"));
    }
    let steered = d.map(|x| x.stat("dpdk_steered"));
    eprintln!("two queues: {took:?}, connection on thread {owners:?}, steered {steered:?}");
    assert_eq!(owners[0], owners[1], "one thread's at both ends");
    (owners[0], steered)
}

/// memif with a queue pair per poll thread: queue k meets queue k, and with the same thread
/// count at both ends a connection's frames arrive on its owner's queue (nothing is steered).
/// Pairs are made until the connection is thread 1's, so that the second queue carries it.
#[test]
fn memif_with_a_queue_pair_per_poll_thread() {
    require!(eal_works(), DPDK_INSTALL);
    let two = ["--poll-core", "-2", "--poll-core", "-2"];
    let mut owners = Vec::new();
    for attempt in 0..16 {
        let pair = VethPair::new();
        let sock = std::env::temp_dir().join(format!(
            "rdsd-memif-q2-{}-{attempt}.sock",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&sock);
        let d0 = pair.memif_daemon_with(0, &sock, 4, "queues = 2", &two);
        let d1 = pair.memif_daemon_with(1, &sock, 4, "queues = 2", &two);
        let (owner, steered) = two_queue_exchange([&d0, &d1], &pair, 7300);
        assert_eq!(steered, [0, 0], "queue k meets queue k: nothing to steer");
        drop((d0, d1));
        let _ = std::fs::remove_file(&sock);
        owners.push(owner);
        if owner == 1 {
            return;
        }
    }
    panic!("no pair put its connection on thread 1: {owners:?}");
}

/// memif ends with different `[dpdk] queues` never connect (the count is part of the memif
/// id): DPDK 22.11's memif server would otherwise accept a client with fewer rings and transmit
/// on rings that were never set up. No message crosses, and both daemons stay up.
#[test]
fn memif_ends_with_different_queue_counts_stay_apart() {
    require!(eal_works(), DPDK_INSTALL);
    let pair = VethPair::new();
    let sock = std::env::temp_dir().join(format!("rdsd-memif-mm-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&sock);
    let two = ["--poll-core", "-2", "--poll-core", "-2"];
    let mut d0 = pair.memif_daemon_with(0, &sock, 2, "queues = 2", &two);
    let mut d1 = pair.memif_daemon_with(1, &sock, 2, "queues = 1", &[]);
    let r = d0.attach();
    let s = r.socket().unwrap();
    s.bind(SocketAddrV4::new(pair.addr(0), 7500)).unwrap();
    s.set_recv_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let mut buf = [0u8; 16];
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(3) {
        // RDS ping (port 0): answered by the peer's engine once a path is up.
        let _ = s.send_to(&[], SocketAddrV4::new(pair.addr(1), 0));
        assert!(
            s.recv_from(&mut buf).is_err(),
            "a pong over a memif link between 2 and 1 queues"
        );
    }
    assert_eq!(d0.stat("dpdk_rx_packets") + d1.stat("dpdk_rx_packets"), 0);
    for d in [&mut d0, &mut d1] {
        let up = d
            .child
            .as_mut()
            .is_some_and(|c| c.try_wait().expect("try_wait").is_none());
        assert!(up, "both daemons up");
    }
    drop((s, r, d0, d1));
    let _ = std::fs::remove_file(&sock);
}

/// af_packet with a queue pair per poll thread (`qpairs=2`): the kernel fans frames out over
/// the two packet sockets by its own flow hash, so frames of one thread's connection arrive on
/// the other's queue, which steers them. 8 paths: 8 TCP flows, hashed each way.
#[test]
fn af_packet_with_a_queue_pair_per_poll_thread_steers_frames_to_their_owner() {
    require!(eal_works(), DPDK_INSTALL);
    let pair = VethPair::new();
    let start = |i: usize| {
        let cfg = dpdk_config(VethPair::iface(i), pair.addr(i), "queues = 2");
        let cfg = cfg.to_str().unwrap().to_string();
        let args = [
            "-c",
            &cfg,
            "--local-addr",
            "127.0.0.0/8",
            "--paths",
            "8",
            "--poll-core",
            "-2",
            "--poll-core",
            "-2",
        ];
        Daemon::start_in(Some(&pair.ns[i]), &args)
    };
    let (d0, d1) = (start(0), start(1));
    let (_, steered) = two_queue_exchange([&d0, &d1], &pair, 7400);
    // Fanned out, not copied: each frame reaches one of the two packet sockets (copied, each
    // would arrive twice). The receiver's count is read first, both exactly (the published
    // counters lag, and keep-alives still flow); the kernel's own frames on the veth (IPv6
    // neighbour discovery) reach the packet sockets too: a few frames of slack.
    for (rx, tx) in [(&d0, &d1), (&d1, &d0)] {
        let got = rx.exact_stat("dpdk_rx_packets");
        let sent = tx.exact_stat("dpdk_tx_packets");
        assert!(got <= sent + 8, "{got} frames received of {sent} sent");
    }
    assert!(
        steered[0] + steered[1] > 0,
        "16 flows hashed by the kernel and none on the other queue: {steered:?}"
    );
}

/// Round trips of 64-byte messages between two hosts through their rdsds (one app thread,
/// blocking receives), and a one-way burst: over DPDK af_packet ports on a veth pair, over
/// DPDK memif ports, and over kernel TCP (a veth pair with the addresses in the kernel), one
/// after the other, with the idle strategy of `RTT_IDLE` (default backoff) and `RTT_COUNT`
/// round trips (default 20000). Not a CI test: run it on a release build, alone:
/// `cargo test --release -p rdsd-tests --test dpdk -- --ignored --nocapture rtt`.
#[test]
#[ignore = "measurement, not a check: run on a release build (see the doc comment)"]
fn rtt_dpdk_vs_kernel_tcp() {
    require!(eal_works(), DPDK_INSTALL);
    let count: u64 = std::env::var("RTT_COUNT").map_or(20_000, |v| v.parse().unwrap());
    let idle = std::env::var("RTT_IDLE").unwrap_or_else(|_| "backoff".into());
    let extra = ["--idle", idle.as_str()];
    for kind in ["dpdk-af_packet", "dpdk-memif", "kernel-tcp"] {
        let pair = VethPair::new();
        let sock = std::env::temp_dir().join(format!("rdsd-memif-rtt-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&sock);
        let (d0, d1) = match kind {
            "dpdk-af_packet" => (
                dpdk_daemon_with(&pair, 0, 1, &extra),
                dpdk_daemon_with(&pair, 1, 1, &extra),
            ),
            "dpdk-memif" => (
                pair.memif_daemon(0, &sock, 1, &extra),
                pair.memif_daemon(1, &sock, 1, &extra),
            ),
            _ => (
                kernel_daemon_with(&pair, 0, 1, &extra),
                kernel_daemon_with(&pair, 1, 1, &extra),
            ),
        };
        let (ra, rb) = (d0.attach(), d1.attach());
        let (a, b) = (ra.socket().unwrap(), rb.socket().unwrap());
        let aa = SocketAddrV4::new(pair.addr(0), 4100);
        let ba = SocketAddrV4::new(pair.addr(1), 4100);
        a.bind(aa).unwrap();
        b.bind(ba).unwrap();
        for s in [&a, &b] {
            s.set_recv_timeout(Some(Duration::from_secs(10))).unwrap();
        }
        let msg = [7u8; 64];
        let mut buf = [0u8; 256];
        let mut rtts = Vec::with_capacity(count as usize);
        for i in 0..count + 1000 {
            let t = Instant::now();
            a.send_to(&msg, ba).unwrap();
            b.recv_from(&mut buf).unwrap();
            b.send_to(&msg, aa).unwrap();
            a.recv_from(&mut buf).unwrap();
            if i >= 1000 {
                rtts.push(t.elapsed().as_nanos() as u64);
            }
        }
        rtts.sort_unstable();
        let q = |f: f64| rtts[((rtts.len() - 1) as f64 * f) as usize] as f64 / 1000.0;
        // One way: 64 B messages back to back, receiver on its own thread.
        b.set_recv_buffer_size(64 << 20).unwrap();
        a.set_send_buffer_size(64 << 20).unwrap();
        let n = count * 5;
        let t = Instant::now();
        std::thread::scope(|sc| {
            sc.spawn(|| {
                let mut buf = [0u8; 256];
                for _ in 0..n {
                    b.recv_from(&mut buf).unwrap();
                }
            });
            for _ in 0..n {
                a.send_to(&msg, ba).unwrap();
            }
        });
        let rate = n as f64 / t.elapsed().as_secs_f64();
        eprintln!(
            "{kind:>14} (idle {idle}): RTT p50 {:.1} us, p90 {:.1} us, p99 {:.1} us \
             ({count} round trips); one-way {:.0} msg/s ({n} x 64 B)",
            q(0.5),
            q(0.9),
            q(0.99),
            rate
        );
        drop((a, b, ra, rb, d0, d1));
        let _ = std::fs::remove_file(&sock);
    }
}

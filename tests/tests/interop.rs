//! Interop with the Linux kernel's own RDS/TCP: rdsd in a network namespace on the host, the
//! kernel (Debian's, under qemu TCG) in a guest on a tap. See `tests/vmlab/README.md`.
//!
//! One VM is booted per run of this file and shared by its tests, one test at a time
//! ([`shared_lab`]). Every test checks exactly-once, in-order delivery per (socket, source)
//! with sequence-numbered payloads, on both sides.

use rdsd_tests::vmlab::{retry_after_nic_reset, shared_lab, Job, LabGuard};
use rdsd_tests::*;
use shm_api::Socket;
use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;

/// The shared lab; without qemu, `shared_lab` fails the test in CI and counts a skip elsewhere
/// (`rdsd_tests::skip_or_fail`), and the test returns.
macro_rules! lab_or_skip {
    () => {
        match shared_lab() {
            Some(l) => l,
            None => return,
        }
    };
}

fn at(ip: Ipv4Addr, port: u16) -> SocketAddrV4 {
    SocketAddrV4::new(ip, port)
}

/// The payload convention of `rdsguest.c`: `seq` (u64 LE) first when `len >= 8`, the rest
/// (or all of it) filled with `seq % 251`.
fn payload(seq: u64, len: usize) -> Vec<u8> {
    let mut v = vec![(seq % 251) as u8; len];
    if len >= 8 {
        v[..8].copy_from_slice(&seq.to_le_bytes());
    }
    v
}

fn host_socket(lab: &LabGuard, port: u16) -> (shm_api::Rdsd, Socket) {
    let r = lab.d().attach();
    let s = r.socket().unwrap();
    s.set_send_buffer_size(4 * MIB).unwrap();
    s.set_send_timeout(Some(Duration::from_secs(120))).unwrap();
    s.bind(at(lab.host, port)).unwrap();
    (r, s)
}

/// Receives `count` messages on `s` within `limit`, checking order per source and, when
/// `sizes` is given, the length of each (cycling). Returns the number of sources. On a
/// timeout it prints both ends' state ([`rdsd_tests::vmlab::VmLab::diagnose`]) first.
fn host_recv(
    lab: &LabGuard,
    s: &Socket,
    count: usize,
    sizes: Option<&[usize]>,
    limit: Duration,
) -> usize {
    let mut buf = vec![0u8; MIB + 16];
    let mut next: HashMap<SocketAddrV4, u64> = HashMap::new();
    let deadline = Instant::now() + limit;
    for i in 0..count {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "timed out after {i} of {count} messages");
        s.set_recv_timeout(Some(left)).unwrap();
        let (n, from) = s.recv_from(&mut buf).unwrap_or_else(|e| {
            let seen: Vec<String> = next.iter().map(|(a, n)| format!("{a}: {n}")).collect();
            eprintln!("recv after {i} of {count} failed ({e}); next per source {seen:?}");
            eprintln!("{}", lab.diagnose());
            panic!("recv after {i} of {count}: {e}")
        });
        let want = next.entry(from).or_insert(0);
        if let Some(sz) = sizes {
            assert_eq!(n, sz[i % sz.len()], "length of message {i} from {from}");
        }
        let seq = if n >= 8 {
            payload_seq(&buf[..n])
        } else {
            *want
        };
        assert_eq!(seq, *want, "message {i} from {from}: order");
        assert!(
            buf[8.min(n)..n].iter().all(|&b| b == (seq % 251) as u8),
            "message {seq} from {from}: payload bytes"
        );
        *want += 1;
    }
    next.len()
}

fn host_send(s: &Socket, dest: SocketAddrV4, count: u64, sizes: &[usize]) {
    for k in 0..count {
        let len = sizes[k as usize % sizes.len()];
        s.send_to(&payload(k, len), dest)
            .unwrap_or_else(|e| panic!("send {k} ({len} B) to {dest}: {e}"));
    }
}

/// 32 sockets bound at `base`.. on the host, 16 per attachment of `rs` (rdsd's
/// `max_sockets_per_app`).
fn thirty_two_senders(lab: &LabGuard, rs: &[shm_api::Rdsd], base: u16) -> Vec<Socket> {
    (0..32)
        .map(|i| {
            let s = rs[i / 16].socket().unwrap();
            s.set_send_timeout(Some(Duration::from_secs(120))).unwrap();
            s.bind(at(lab.host, base + i as u16)).unwrap();
            s
        })
        .collect()
}

/// 200 messages of 200 B (sequence-numbered) from each sender to `to`.
fn send_200_each(senders: &[Socket], to: SocketAddrV4) {
    for k in 0..200 {
        for s in senders {
            s.send_to(&payload(k, 200), to).unwrap();
        }
    }
}

/// The guest's receiver `rx` took all 6400 messages of 32 sources, each in order.
fn expect_6400_from_32(rx: &Job) {
    let done = rx.expect("done", Duration::from_secs(300));
    assert_eq!(
        (
            field(&done, "got"),
            field(&done, "sources"),
            field(&done, "bad")
        ),
        (6400, 32, 0),
        "{done}"
    );
}

fn field(line: &str, key: &str) -> u64 {
    Job::field(line, key)
}

/// Messages both ways between rdsd and a guest address `guest`.
fn both_ways(lab: &LabGuard, guest: Ipv4Addr, port: u16, warm: bool) {
    let (_r, s) = host_socket(lab, port);
    if warm {
        // Bring the connection up first (a3 shows why).
        let rx = lab.guest(&format!("recv {guest}:{} 1 60000", port + 2));
        rx.expect("bound", Duration::from_secs(30));
        s.send_to(&payload(0, 10), at(guest, port + 2)).unwrap();
        rx.expect("done", Duration::from_secs(60));
    }
    let rx = lab.guest(&format!("recv {guest}:{port} 1000 120000"));
    rx.expect("bound", Duration::from_secs(30));
    let tx = lab.guest(&format!(
        "send {guest}:{} {}:{port} 1000 300",
        port + 1,
        lab.host
    ));
    host_send(&s, at(guest, port), 1000, &[300]);
    assert_eq!(
        host_recv(lab, &s, 1000, Some(&[300]), Duration::from_secs(120)),
        1
    );
    let done = rx.expect("done", Duration::from_secs(120));
    assert_eq!(
        (field(&done, "got"), field(&done, "bad")),
        (1000, 0),
        "{done}"
    );
    tx.expect("sent", Duration::from_secs(30));
}

#[test]
fn a1_both_ways_guest_address_smaller() {
    retry_after_nic_reset(|| {
        let lab = lab_or_skip!();
        let g = lab.guest_low;
        both_ways(&lab, g, 7000, false);
        // The smaller address (the guest) connected: rdsd accepted its paths.
        assert!(lab.d().stat("tcp_accepts") >= 1);
        // The kernel answers rdsd's probe on a connection it made: rdsd's data never waited for
        // the path-0 gate's deadline.
        assert_eq!(lab.d().stat("tcp_path0_gate_timeouts"), 0);
        // The RDS_INFO tables rdsd serves through the preload library (`rdsguest info`, `info6`;
        // preload.rs) read the same from the kernel: the connection, up, in the v4 table and,
        // v4-mapped, in the IPv6 one.
        for cmd in ["info", "info6"] {
            let j = lab.guest(cmd);
            let conn = j.expect(
                &format!("conn laddr={g} faddr={} ", lab.host),
                Duration::from_secs(30),
            );
            assert!(conn.ends_with(" transport=tcp flags=4"), "{cmd}: {conn}");
            j.expect("info conns=", Duration::from_secs(30));
        }
    });
}

#[test]
fn a2_both_ways_guest_address_larger() {
    retry_after_nic_reset(|| {
        let lab = lab_or_skip!();
        let g = lab.guest_high;
        both_ways(&lab, g, 7010, true);
        assert!(lab.d().stat("tcp_connects") >= 1);
    });
}

/// The kernel (larger address) can drop an accepted path 0 whose bytes TCP acknowledged before
/// its RDS layer took the socket; rdsd's data waits for the probe's pong (the path-0 data gate
/// in rds-proto) so that nothing sent at connection start is lost.
#[test]
fn a3_rdsd_sends_at_connection_start_to_a_larger_kernel() {
    retry_after_nic_reset(|| {
        let lab = lab_or_skip!();
        // An address no other test uses: the connection starts with the first message.
        let g = lab.guest_high2;
        both_ways(&lab, g, 7020, false);
    });
}

const SIZES: [usize; 5] = [0, 1, 4096, 65536, MIB];

#[test]
fn b1_sizes_both_ways() {
    retry_after_nic_reset(|| {
        let lab = lab_or_skip!();
        for (g, port) in [(lab.guest_low, 7100), (lab.guest_high, 7110)] {
            let (_r, s) = host_socket(&lab, port);
            let list = SIZES.map(|x| x.to_string()).join(",");
            let rx = lab.guest(&format!("recv {g}:{port} 10 180000 sizes={list}"));
            rx.expect("bound", Duration::from_secs(30));
            host_send(&s, at(g, port), 10, &SIZES);
            let done = rx.expect("done", Duration::from_secs(180));
            assert_eq!(field(&done, "bad"), 0, "{done}");
            let tx = lab.guest(&format!(
                "send {g}:{} {}:{port} 10 0 sizes={list}",
                port + 1,
                lab.host
            ));
            host_recv(&lab, &s, 10, Some(&SIZES), Duration::from_secs(180));
            tx.expect("sent", Duration::from_secs(30));
        }
    });
}

#[test]
fn b2_two_hundred_mib_messages_from_the_kernel_to_a_slow_receiver() {
    retry_after_nic_reset(|| {
        let lab = lab_or_skip!();
        let g = lab.guest_low;
        let (_r, s) = host_socket(&lab, 7120);
        let tx = lab.guest(&format!(
            "send {g}:7121 {}:7120 200 {MIB} linger=60",
            lab.host
        ));
        let mut buf = vec![0u8; MIB];
        let start = Instant::now();
        for i in 0..200u64 {
            s.set_recv_timeout(Some(Duration::from_secs(120))).unwrap();
            let (n, _) = s
                .recv_from(&mut buf)
                .unwrap_or_else(|e| panic!("message {i}: {e}"));
            assert_eq!(n, MIB);
            assert_eq!(payload_seq(&buf), i);
            assert!(buf[8..].iter().all(|&b| b == (i % 251) as u8));
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!("200 x 1 MiB kernel -> rdsd in {:?}", start.elapsed());
        let sent = tx.expect("sent", Duration::from_secs(30));
        eprintln!("kernel sender: {sent}");
    });
}

#[test]
fn c_kernel_pings_rdsd_port_zero() {
    retry_after_nic_reset(|| {
        let lab = lab_or_skip!();
        for (g, port) in [(lab.guest_low, 7200), (lab.guest_high, 7201)] {
            let before = lab.d().stat("tcp_pings_received");
            let j = lab.guest(&format!("ping {g}:{port} {}:0 5", lab.host));
            let r = j.expect("pings", Duration::from_secs(60));
            assert_eq!(field(&r, "ok"), 5, "{r}");
            wait_for(
                || lab.d().stat("tcp_pings_received") >= before + 5,
                Duration::from_secs(5),
                "rdsd counted the pings",
            );
        }
    });
}

/// rds-ping from rdsd: an app sends zero-byte messages to the kernel's port 0; the kernel
/// answers each with a zero-byte pong from port 0, which rdsd delivers to the app.
#[test]
fn c2_rdsd_app_pings_the_kernel_port_zero() {
    retry_after_nic_reset(|| {
        let lab = lab_or_skip!();
        for (g, port) in [(lab.guest_low, 7210), (lab.guest_high, 7211)] {
            let (_r, s) = host_socket(&lab, port);
            s.set_recv_timeout(Some(Duration::from_secs(10))).unwrap();
            let mut buf = [0u8; 64];
            for i in 0..5 {
                let t = Instant::now();
                s.send_to(&[], at(g, 0)).unwrap();
                let (len, from) = s
                    .recv_from(&mut buf)
                    .unwrap_or_else(|e| panic!("pong {i} from {g}: {e}"));
                assert_eq!((len, from), (0, at(g, 0)), "pong {i}");
                eprintln!("rds ping {g}: {} us", t.elapsed().as_micros());
            }
        }
    });
}

/// The guest kernel's congestion-map counters and its RDS/TCP connections to rdsd's address
/// (`rdsguest counters`, i.e. rds-info -c / -n): (maps received, maps queued, connections).
fn kernel_cong_counters(lab: &LabGuard) -> (u64, u64, u64) {
    let j = lab.guest(&format!("counters {}:0", lab.host));
    let line = j.expect("counters", Duration::from_secs(30));
    (
        field(&line, "cong_rx"),
        field(&line, "cong_queued"),
        field(&line, "conns"),
    )
}

/// rdsd's local congestion changes and its path-ups (each path-up sends the map once).
fn rdsd_cong_events(lab: &LabGuard) -> u64 {
    let d = lab.d();
    d.stat("cong_marked") + d.stat("cong_cleared") + d.stat("tcp_path_up") + d.stat("tcp_accepts")
}

#[test]
fn d1_slow_rdsd_receiver_congests_the_kernel_sender_which_recovers() {
    retry_after_nic_reset(|| {
        let lab = lab_or_skip!();
        let (kernel_rx0, _, _) = kernel_cong_counters(&lab);
        let sent0 = lab.d().stat("tcp_cong_maps_sent");
        let events0 = rdsd_cong_events(&lab);
        let g = lab.guest_low;
        let r = lab.d().attach();
        let rcv = r.socket().unwrap();
        rcv.set_recv_buffer_size(4096).unwrap();
        rcv.bind(at(lab.host, 7300)).unwrap();
        let j = lab.guest(&format!("cong {g}:7301 {}:7300", lab.host));
        let n = field(&j.expect("enobufs", Duration::from_secs(60)), "n");
        assert!(n >= 4, "ENOBUFS after {n}");
        std::thread::sleep(Duration::from_millis(500));
        let mut buf = [0u8; 2048];
        rcv.set_recv_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut next = 0;
        // Everything the kernel sent before the map arrived, then the recovery message.
        while next < n {
            let (len, _) = rcv.recv_from(&mut buf).unwrap();
            assert_eq!(payload_seq(&buf[..len]), next);
            next += 1;
        }
        j.expect("cong_update", Duration::from_secs(60));
        let rec = j.expect("recovered", Duration::from_secs(60));
        assert_eq!(field(&rec, "n"), n + 1);
        let (len, _) = rcv.recv_from(&mut buf).unwrap();
        assert_eq!(payload_seq(&buf[..len]), n);

        // The maps on the wire: what the kernel received is what rdsd counts as sent, and at most
        // one per change (or path-up) per connection.
        std::thread::sleep(Duration::from_millis(500));
        let (kernel_rx1, _, conns) = kernel_cong_counters(&lab);
        let kernel_rx = kernel_rx1 - kernel_rx0;
        let sent = lab.d().stat("tcp_cong_maps_sent") - sent0;
        let events = rdsd_cong_events(&lab) - events0;
        eprintln!(
            "congestion maps: rdsd sent {sent}, kernel received {kernel_rx}, \
             rdsd changes + path-ups {events}, connections {conns}"
        );
        assert_eq!(kernel_rx, sent, "rdsd's count is the wire's");
        assert!(kernel_rx >= 2, "the map went out congested, then cleared");
        assert!(
            kernel_rx <= events * conns.max(1),
            "at most one map per change per connection"
        );
    });
}

#[test]
fn d2_small_kernel_rcvbuf_congests_the_rdsd_sender_which_recovers() {
    retry_after_nic_reset(|| {
        let lab = lab_or_skip!();
        let (_, kernel_queued0, _) = kernel_cong_counters(&lab);
        let received0 = lab.d().stat("tcp_cong_maps_received");
        let g = lab.guest_high;
        let (_r, s) = host_socket(&lab, 7310);
        let rx = lab.guest(&format!(
            "recv {g}:7311 100000 180000 rcvbuf=4096 hold_ms=8000 idle_ms=5000"
        ));
        rx.expect("bound", Duration::from_secs(30));
        s.set_nonblocking(true).unwrap();
        let dest = at(g, 7311);
        let mut n = 0u64;
        let t = Instant::now();
        let err = loop {
            match s.send_to(&payload(n, 1000), dest) {
                Ok(_) => n += 1,
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                    std::thread::sleep(Duration::from_millis(1))
                }
                Err(e) => break e,
            }
            assert!(
                t.elapsed() < Duration::from_secs(7),
                "no ENOBUFS after {n} sends"
            );
        };
        assert_eq!(err.raw_os_error(), Some(libc::ENOBUFS), "{err}");
        assert!(n >= 4, "ENOBUFS after {n}");
        rx.expect("reading", Duration::from_secs(30));
        wait_for(
            || match s.send_to(&payload(n, 1000), dest) {
                Ok(_) => true,
                Err(e) => {
                    assert!(
                        matches!(e.raw_os_error(), Some(libc::ENOBUFS | libc::EAGAIN)),
                        "{e}"
                    );
                    false
                }
            },
            Duration::from_secs(60),
            "the kernel's congestion to clear",
        );
        n += 1;
        let done = rx.expect("done", Duration::from_secs(60));
        assert_eq!(
            (
                field(&done, "got"),
                field(&done, "bad"),
                field(&done, "first")
            ),
            (n, 0, 0),
            "{done}"
        );
        let (_, kernel_queued1, _) = kernel_cong_counters(&lab);
        let received = lab.d().stat("tcp_cong_maps_received") - received0;
        eprintln!(
            "congestion maps from the kernel: rdsd received {received}, kernel queued {}",
            kernel_queued1 - kernel_queued0
        );
        assert!(
            received >= 2,
            "the kernel's map, congested then cleared, reached rdsd"
        );
    });
}

#[test]
fn e_mprds_eight_paths_and_thirty_two_sockets_each_way_from_the_start() {
    retry_after_nic_reset(|| {
        let lab = lab_or_skip!();
        // A guest address no other test uses, so the connection starts with this test.
        let g = lab.guest_mp;
        let before = lab.d().stat("tcp_accepts");
        // rdsd allows 16 sockets per attached process (max_sockets_per_app): attach 3 times.
        let rs: Vec<shm_api::Rdsd> = (0..3).map(|_| lab.d().attach()).collect();
        let sink = rs[2].socket().unwrap();
        sink.bind(at(lab.host, 7400)).unwrap();
        let senders = thirty_two_senders(&lab, &rs, 7500);
        let rx = lab.guest(&format!("recv {g}:7400 6400 300000"));
        rx.expect("bound", Duration::from_secs(30));
        let tx = lab.guest(&format!(
            "send {g}:7500 {}:7400 200 200 nsock=32 linger=30",
            lab.host
        ));
        send_200_each(&senders, at(g, 7400));
        assert_eq!(
            host_recv(&lab, &sink, 6400, None, Duration::from_secs(300)),
            32
        );
        expect_6400_from_32(&rx);
        tx.expect("sent", Duration::from_secs(30));
        // The guest (smaller address) connected the 8 paths the kernel offers.
        assert_eq!(lab.d().stat("tcp_accepts") - before, 8);
    });
}

/// As `e` with rdsd as the active side (the guest takes a fresh, larger address): rdsd connects
/// the 8 paths, and 32 rdsd sockets send from the first instant, so data goes out on every path
/// as soon as it may. rdsd's paths > 0 carry no data until a pong on path 0 answers a probe
/// ping started after they came up (the restart path-mapping rule, `handle_connected` in
/// rds-proto): this checks that the kernel's pongs release them and that nothing stalls.
#[test]
fn e3_mprds_rdsd_connects_eight_paths_and_sends_from_the_start() {
    retry_after_nic_reset(|| {
        let lab = lab_or_skip!();
        let o = lab.host.octets();
        let g = Ipv4Addr::new(o[0], o[1], o[2], 210);
        lab.guest_sh(&format!("ip addr add {g}/24 dev eth0"))
            .expect("exit 0", Duration::from_secs(30));
        let connects = lab.d().stat("tcp_connects");
        let mismaps = lab.d().stat("tcp_path_mismaps");
        let rs: Vec<shm_api::Rdsd> = (0..2).map(|_| lab.d().attach()).collect();
        let senders = thirty_two_senders(&lab, &rs, 7800);
        let rx = lab.guest(&format!("recv {g}:7790 6400 300000"));
        rx.expect("bound", Duration::from_secs(30));
        send_200_each(&senders, at(g, 7790));
        expect_6400_from_32(&rx);
        // rdsd (the smaller address) connected every path the kernel offers, none of them taken
        // for another path by the kernel.
        let connects = lab.d().stat("tcp_connects") - connects;
        eprintln!("rdsd's connect attempts: {connects}");
        assert!(connects >= 8, "{connects} connects");
        assert_eq!(lab.d().stat("tcp_path_mismaps") - mismaps, 0);
    });
}

/// What [`resilient_recv`] saw.
struct AcrossRestarts {
    got: u64,
    /// (first missing, first received after it) of each gap.
    gaps: Vec<(u64, u64)>,
    restarts: u64,
    /// `drop_unbound_dest` summed over every rdsd instance (each counts from 0).
    unbound_drops: u64,
}

/// Receives `count` sequence-numbered messages on `first` while rdsd is SIGKILLed and restarted
/// whenever `restart_at(got)` says so; re-attaches and binds `port` again after each restart.
/// Asserts no duplicate, no reordering, and that a gap only ever shows in the first message
/// after a restart: what TCP acknowledged to the sender but the app had not read when rdsd
/// died (RDS/TCP takes the acknowledgement as delivery) is lost, and nothing else.
fn resilient_recv(
    lab: &mut LabGuard,
    first: (shm_api::Rdsd, Socket),
    port: u16,
    count: u64,
    limit: Duration,
    mut restart_at: impl FnMut(u64) -> bool,
) -> AcrossRestarts {
    let (mut r, mut s) = first;
    let mut buf = vec![0u8; 4096];
    let mut seen = AcrossRestarts {
        got: 0,
        gaps: Vec::new(),
        restarts: 0,
        unbound_drops: 0,
    };
    let mut next = 0u64;
    // Set when the app re-attached: messages before that are what the dead rdsd had put in the
    // ring (in order), the first one after it may follow a gap.
    let mut first_after_reattach = false;
    let deadline = Instant::now() + limit;
    while next < count {
        if restart_at(seen.got) {
            seen.unbound_drops += lab.d().exact_stat("drop_unbound_dest");
            seen.restarts += 1;
            lab.kill_rdsd();
            lab.start_rdsd();
        }
        s.set_recv_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        match s.recv_from(&mut buf) {
            Ok((n, _)) => {
                let seq = payload_seq(&buf[..n]);
                assert!(seq >= next, "duplicate or reordered: {seq} after {next}");
                if seq > next {
                    assert!(
                        first_after_reattach,
                        "a gap {next}..{seq} in the middle of one rdsd's life"
                    );
                    eprintln!("gap: {next}..{seq}");
                    seen.gaps.push((next, seq));
                }
                first_after_reattach = false;
                next = seq + 1;
                seen.got += 1;
            }
            Err(e) if shm_api::is_daemon_gone(&e) => {
                drop(s);
                drop(r);
                wait_for(
                    || lab.d().child.is_some(),
                    Duration::from_secs(30),
                    "rdsd restarted",
                );
                (r, s) = host_socket(lab, port);
                first_after_reattach = true;
            }
            Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::ETIMEDOUT)) => {}
            Err(e) => panic!("recv: {e}"),
        }
        assert!(
            Instant::now() < deadline,
            "timed out at {next} of {count} (got {}, gaps {:?})",
            seen.got,
            seen.gaps
        );
    }
    seen.unbound_drops += lab.d().exact_stat("drop_unbound_dest");
    seen
}

/// rdsd SIGKILLed and restarted 10 times while the kernel streams. Each restart may lose what
/// TCP had acknowledged to the kernel but the app had not read yet (in rdsd, in the socket's
/// ring, in the host's socket buffer): their number is the stream's rate times how far the
/// app lagged at that instant, which load stretches (CI once saw 127 lost in 10 restarts, the
/// old bound was 10 per restart: a timing assumption). So the test counts, it does not bound
/// that: one gap at most per restart and only right at it, no duplicate, no reordering, and
/// no message dropped for the port not bound again yet in any rdsd instance (the rebind
/// grace; without it 80-100 per restart were dropped there).
#[test]
fn f1_rdsd_sigkilled_and_restarted_ten_times_while_the_kernel_streams() {
    retry_after_nic_reset(|| {
        const RESTARTS: u64 = 10;
        const COUNT: u64 = 4400;
        let mut lab = lab_or_skip!();
        let g = lab.guest_low;
        let host = lab.host;
        // Paced, so that the stream outlasts the restarts. Bound before the sender starts: a
        // message to an unbound port is dropped (a gap at the start).
        let sock = host_socket(&lab, 7600);
        let tx = lab.guest(&format!(
            "send {g}:7601 {host}:7600 {COUNT} 500 delay_us=2000 linger=120"
        ));
        tx.expect("bound", Duration::from_secs(30));
        let mut kills = 0u64;
        let seen = resilient_recv(
            &mut lab,
            sock,
            7600,
            COUNT,
            Duration::from_secs(400),
            |got| {
                let now = kills < RESTARTS && got >= 300 * (kills + 1);
                kills += u64::from(now);
                now
            },
        );
        let lost = COUNT - seen.got;
        eprintln!(
            "{} rdsd restarts under a kernel sender: got {} of {COUNT} (lost {lost}), gaps {:?}; \
             dropped for the port not bound yet {}; the last rdsd dropped {} resends as duplicates",
            seen.restarts,
            seen.got,
            seen.gaps,
            seen.unbound_drops,
            lab.d().exact_stat("tcp_drop_dup_seq")
        );
        assert_eq!(seen.restarts, RESTARTS);
        assert!(
            seen.gaps.len() as u64 <= seen.restarts,
            "at most one gap per restart, at the restart point"
        );
        let in_gaps: u64 = seen.gaps.iter().map(|(a, b)| b - a).sum();
        assert_eq!(in_gaps, lost, "every lost message is in a restart's gap");
        assert_eq!(seen.unbound_drops, 0, "the rebind grace held them");
        assert!(lab.d().stat("tcp_rx_state_restored") >= 1);
    });
}

#[test]
fn f2_link_cut_and_restored_mid_stream_loses_nothing() {
    retry_after_nic_reset(|| {
        let lab = lab_or_skip!();
        let g = lab.guest_high;
        let host = lab.host;
        let (_r, s) = host_socket(&lab, 7610);
        let (_r2, out) = host_socket(&lab, 7612);
        let rx = lab.guest(&format!("recv {g}:7610 2000 240000"));
        rx.expect("bound", Duration::from_secs(30));
        let tx = lab.guest(&format!("send {g}:7611 {host}:7610 2000 500 linger=60"));
        let th = std::thread::scope(|sc| {
            let h = sc.spawn(|| host_recv(&lab, &s, 2000, Some(&[500]), Duration::from_secs(240)));
            for k in 0..2000u64 {
                if k == 600 {
                    lab.link(false);
                    std::thread::sleep(Duration::from_secs(3));
                    lab.link(true);
                }
                out.send_to(&payload(k, 500), at(g, 7610)).unwrap();
            }
            h.join().unwrap()
        });
        assert_eq!(th, 1);
        let done = rx.expect("done", Duration::from_secs(240));
        assert_eq!(
            (field(&done, "got"), field(&done, "bad")),
            (2000, 0),
            "{done}"
        );
        tx.expect("sent", Duration::from_secs(30));
    });
}

#[test]
fn f3_guest_vm_restarted() {
    retry_after_nic_reset(|| {
        let mut lab = lab_or_skip!();
        let g = lab.guest_high;
        let (_r, s) = host_socket(&lab, 7620);
        let rx = lab.guest(&format!("recv {g}:7620 100 60000"));
        rx.expect("bound", Duration::from_secs(30));
        host_send(&s, at(g, 7620), 100, &[100]);
        rx.expect("done", Duration::from_secs(60));
        // Let the guest's delayed TCP ACKs for the last messages reach rdsd first: a message
        // still unacknowledged when the guest dies is resent to the rebooted kernel, which takes
        // it as new (the 6.1 kernel sends no GEN_NUM), and `first` below would start before 100.
        std::thread::sleep(Duration::from_secs(1));
        lab.kill_vm();
        // Sent while the guest is down: rdsd keeps them and resends after it is back.
        for k in 100..150u64 {
            s.send_to(&payload(k, 100), at(g, 7620)).unwrap();
        }
        lab.boot().expect("reboot");
        // Up to 200 (it stops 10 s after the last message): every resend is counted.
        let rx = lab.guest(&format!("recv {g}:7620 200 120000 idle_ms=10000"));
        rx.expect("bound", Duration::from_secs(30));
        for k in 150..200u64 {
            s.send_to(&payload(k, 100), at(g, 7620)).unwrap();
        }
        // A fresh kernel receiver: rdsd resends what the old kernel never acknowledged (from
        // 100 at most), then the rest, in order and with no duplicate (checked by the guest).
        let done = rx.expect("done", Duration::from_secs(120));
        eprintln!("after the guest's reboot: {done}");
        let (got, first, last) = (
            field(&done, "got"),
            field(&done, "first"),
            field(&done, "last"),
        );
        assert_eq!(field(&done, "bad"), 0, "{done}");
        assert!((100..=150).contains(&first), "{done}");
        assert_eq!((last, got), (199, 200 - first), "{done}");
        let back = lab.guest(&format!("send {g}:7621 {}:7620 50 100", lab.host));
        host_recv(&lab, &s, 50, Some(&[100]), Duration::from_secs(120));
        back.expect("sent", Duration::from_secs(30));
        // A guest that died without a FIN leaves rdsd's old connection to guest_low half open
        // (f4); start over so that later tests see a clean rdsd.
        lab.kill_rdsd();
        lab.start_rdsd();
    });
}

/// The guest (the smaller address, so the active side) dies without a FIN and reboots; its
/// new kernel connects to rdsd, whose 8 old passive paths to it still look up. Two rdsd bugs
/// were found here. Without TCP keepalive on its data sockets (spec 6.1) the half-open paths
/// stayed up forever and every reconnect was reset (48 643 resets in 120 s). With it, the
/// test still failed about half the time: when the kernel connected before keepalive had
/// freed a path, rdsd reset the connect after its TCP had acknowledged the kernel's one
/// handshake ping, and the kernel's sender, asleep until a handshake pong, never woke (`ss`
/// then showed 8 idle ESTABLISHED paths, the new ones; `tests/vmlab/README.md`). Now such a
/// connect waits parked while a liveness check pings every up path and closes those without a
/// pong within 3 s (rds-proto, `Connection::handle_accepted`). The rebooted kernel's resets
/// for the old 4-tuples are dropped here, so only the check can free them in time.
#[test]
fn f4_rebooted_kernel_reconnects_to_rdsd_as_the_active_side() {
    retry_after_nic_reset(|| {
        let mut lab = lab_or_skip!();
        let low = lab.guest_low;
        let host = lab.host;
        // An established connection from the guest (it has the smaller address)...
        let (_r, s) = host_socket(&lab, 7640);
        let tx = lab.guest(&format!("send {low}:7641 {host}:7640 10 100"));
        host_recv(&lab, &s, 10, Some(&[100]), Duration::from_secs(60));
        tx.expect("sent", Duration::from_secs(30));
        // ... then the guest dies without closing it, and comes back. The new kernel's resets
        // for the old 4-tuples are dropped, so that only the liveness check can free them in time
        // (keepalive would give up after 30 s, 10 times its deadline), whenever the kernel
        // connects. All 8 paths up (a lost handshake ACK can leave one in SYN-RECV for a while): with a free
        // path the new kernel's path 0 would simply take it (classic mapping) and nothing would
        // test the stale ones.
        let mut old_ports = Vec::new();
        wait_for(
            || {
                old_ports = guest_ports_of_established_paths(&lab, low);
                old_ports.len() == 8
            },
            Duration::from_secs(30),
            "8 established paths from the guest",
        );
        lab.kill_vm();
        lab.nft(&format!(
            "table ip f4 {{\n chain in {{\n  type filter hook prerouting priority 0; policy accept;\n  \
             ip saddr {low} tcp dport 16385 tcp sport {{ {} }} tcp flags & rst == rst drop\n }}\n}}\n",
            old_ports.join(", ")
        ));
        lab.boot().expect("reboot");
        let refused = lab.d().exact_stat("tcp_accepts_refused");
        let tx = lab.guest(&format!("send {low}:7641 {host}:7640 100 100 linger=150"));
        // The kernel's first connect waits, parked, until the liveness check has closed the old
        // paths (3 s), then takes path 0; keepalive alone would need about 30 s.
        let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            host_recv(&lab, &s, 100, Some(&[100]), Duration::from_secs(120))
        }));
        let refused = lab.d().exact_stat("tcp_accepts_refused") - refused;
        let stale = lab.d().exact_stat("tcp_stale_paths_closed");
        {
            let stats = lab.d().exact_stats();
            let nonzero: Vec<&str> = stats
                .lines()
                .filter(|l| l.starts_with("tcp_") && !l.ends_with(" 0"))
                .collect();
            let ss = std::process::Command::new("ip")
                .args(["netns", "exec", &lab.ns, "ss", "-tnoie"])
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default();
            eprintln!("rdsd: {nonzero:?}");
            if got.is_err() {
                // What the guest's sender said (its lines are echoed as they are read) and the
                // end of its console: a failed `send` or RDS module shows there.
                eprintln!("ss:\n{ss}");
                eprintln!(
                    "guest job: {:?}",
                    tx.try_expect("sent", Duration::from_secs(1))
                );
                let console = lab.console();
                let mut from = console.len().saturating_sub(4000);
                while !console.is_char_boundary(from) {
                    from += 1;
                }
                let tail = &console[from..];
                eprintln!("guest console (end):\n{tail}");
            }
        }
        lab.nft_flush();
        eprintln!(
            "rdsd reset {refused} connects of the rebooted kernel; liveness checks {}, stale paths \
             closed {}, paths down {}",
            lab.d().stat("tcp_liveness_checks"),
            stale,
            lab.d().stat("tcp_path_down")
        );
        lab.kill_rdsd();
        lab.start_rdsd();
        assert!(
            got.is_ok(),
            "the rebooted kernel's messages never arrived; rdsd reset {refused} of its connects"
        );
        assert!(stale >= 1, "the liveness check closed the old paths");
        tx.expect("sent", Duration::from_secs(30));
    });
}

/// The guest's TCP ports of rdsd's established paths from `guest` (`ss` in the namespace).
fn guest_ports_of_established_paths(lab: &LabGuard, guest: Ipv4Addr) -> Vec<String> {
    let out = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            &lab.ns,
            "ss",
            "-tnH",
            "state",
            "established",
        ])
        .output()
        .expect("ss (iproute2)");
    let prefix = format!("{guest}:");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(&format!("{}:16385", lab.host)))
        .filter_map(|l| {
            l.split_whitespace()
                .find_map(|w| w.strip_prefix(&prefix).map(str::to_string))
        })
        .collect()
}

/// 2% loss and 1% duplication of the namespace's TCP segments on the tap, both directions.
const FAULTS: &str = "table ip fault {
    chain out {
        type filter hook output priority 0; policy accept;
        meta l4proto tcp numgen random mod 100 < 2 drop
    }
    chain fwd_in {
        type filter hook prerouting priority 0; policy accept;
        iifname \"tap0\" meta l4proto tcp numgen random mod 100 < 2 drop
    }
    chain dupl {
        type filter hook postrouting priority 0; policy accept;
        meta l4proto tcp oifname \"tap0\" numgen random mod 100 < 1 dup to ip daddr device \"tap0\"
    }
}";

#[test]
fn g_two_percent_loss_one_percent_duplication_ten_thousand_each_way() {
    retry_after_nic_reset(|| {
        let lab = lab_or_skip!();
        let g = lab.guest_low;
        let host = lab.host;
        let (_r, s) = host_socket(&lab, 7700);
        let (_r2, out) = host_socket(&lab, 7702);
        let rx = lab.guest(&format!("recv {g}:7700 10000 400000"));
        rx.expect("bound", Duration::from_secs(30));
        lab.nft(FAULTS);
        let tx = lab.guest(&format!("send {g}:7701 {host}:7700 10000 200 linger=120"));
        std::thread::scope(|sc| {
            let h = sc.spawn(|| host_recv(&lab, &s, 10000, Some(&[200]), Duration::from_secs(400)));
            host_send(&out, at(g, 7700), 10000, &[200]);
            assert_eq!(h.join().unwrap(), 1);
        });
        let done = rx.expect("done", Duration::from_secs(400));
        assert_eq!(
            (field(&done, "got"), field(&done, "bad")),
            (10000, 0),
            "{done}"
        );
        tx.expect("sent", Duration::from_secs(60));
        lab.nft_flush();
    });
}

/// Connection start with the kernel as the smaller (connecting) address, repeated on fresh
/// connections (a new guest address each round): 32 kernel sockets send at once, from the
/// first instant, while the kernel negotiates 8 paths and moves each socket from path 0 to its
/// hashed path. Per-socket order is checked at rdsd's receiver. With RDSD_VMLAB_CAPTURE=DIR,
/// each round's traffic is captured to DIR/round-N.pcap (tcpdump in the lab namespace).
#[test]
fn e2_kernel_sender_order_at_connection_start_on_fresh_connections() {
    retry_after_nic_reset(|| {
        let lab = lab_or_skip!();
        let rounds: u8 = std::env::var("RDSD_E2_ROUNDS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(6);
        let capture_dir = std::env::var_os("RDSD_VMLAB_CAPTURE").map(std::path::PathBuf::from);
        let r = lab.d().attach();
        let sink = r.socket().unwrap();
        sink.bind(at(lab.host, 7450)).unwrap();
        let mut buf = vec![0u8; 4096];
        let mut reorders = 0;
        let refused_before = lab.d().exact_stat("tcp_accepts_refused");
        for round in 0..rounds {
            let o = lab.host.octets();
            let g = Ipv4Addr::new(o[0], o[1], o[2], 30 + round);
            lab.guest_sh(&format!("ip addr add {g}/24 dev eth0"))
                .expect("exit 0", Duration::from_secs(30));
            let cap = capture_dir.as_ref().map(|d| {
                std::fs::create_dir_all(d).unwrap();
                let c = lab.capture(&d.join(format!("round-{round}.pcap")));
                std::thread::sleep(Duration::from_millis(500));
                c
            });
            let tx = lab.guest(&format!(
                "send {g}:7500 {}:7450 50 200 nsock=32 linger=5",
                lab.host
            ));
            let mut next: HashMap<SocketAddrV4, u64> = HashMap::new();
            let mut late = Vec::new();
            sink.set_recv_timeout(Some(Duration::from_secs(120)))
                .unwrap();
            for i in 0..32 * 50 {
                let (n, from) = match sink.recv_from(&mut buf) {
                    Ok(r) => r,
                    Err(e) => {
                        let short: Vec<String> = next
                            .iter()
                            .filter(|(_, &n)| n < 50)
                            .map(|(a, n)| format!("{}:{n}", a.port()))
                            .collect();
                        let sent = tx.try_expect("sent", Duration::from_secs(5));
                        let stats = lab.d().exact_stats();
                        let counters: Vec<&str> = stats
                            .lines()
                            .filter(|l| {
                                l.starts_with("tcp_") && !l.ends_with(" 0") || l.starts_with("drop")
                            })
                            .collect();
                        panic!(
                            "round {round}: recv after {i}: {e}; {} sources seen, short ones \
                             (port:next) {short:?}; guest: {sent:?}; rdsd: {counters:?}",
                            next.len()
                        );
                    }
                };
                let seq = payload_seq(&buf[..n]);
                let want = next.entry(from).or_insert(0);
                if seq != *want {
                    late.push(format!("{from}: {seq} when {want} was next"));
                }
                *want = (*want).max(seq + 1);
            }
            tx.expect("sent", Duration::from_secs(60));
            drop(cap);
            eprintln!(
                "round {round} ({g}): {} out-of-order arrivals {:?}",
                late.len(),
                &late[..late.len().min(4)]
            );
            reorders += late.len();
        }
        assert_eq!(
            reorders, 0,
            "the kernel's per-socket order at connection start"
        );
        // A reset after TCP acknowledged the kernel's first bytes on a path loses them (seen: 5
        // of 1600 missing when rdsd reset paths > 0 that the kernel connected before rdsd knew
        // the path count). Connections wait instead (rds-proto's `AcceptError::CheckingPaths`).
        let stats = lab.d().exact_stats();
        eprintln!(
            "liveness checks {} (stale paths closed {}), dropped for no bound port {}",
            stat_from(&stats, "tcp_liveness_checks"),
            stat_from(&stats, "tcp_stale_paths_closed"),
            stat_from(&stats, "drop_unbound_dest")
        );
        assert_eq!(
            stat_from(&stats, "tcp_accepts_refused") - refused_before,
            0,
            "no connection of the kernel was reset"
        );
    });
}

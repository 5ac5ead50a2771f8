//! The quiet fast path (ARCHITECTURE.md, invariant 4), counted on the real daemon: in steady
//! traffic its poll threads make no heap allocation (`poll_allocations`, counted by rdsd's
//! allocator), take none of rdsd's locks (`poll_locks`) and, where the transport does not go
//! through the kernel, make no system call at all (`strace -c` on every poll thread).
//!
//! Each test warms its exchange up (connections, paths, rings and stashes grown to what the
//! traffic needs), then counts over the next round trips. The apps receive without ever
//! sleeping in rdsd's library (non-blocking tries and `sched_yield`,
//! `PingPong::start_spinning_on`) and the poll threads spin (`--idle spin`): a sleeping app
//! needs a `futex_wake` and a parked poll thread a `ppoll`, the two documented exceptions,
//! which are not steady state.
//!
//! With two poll threads and an app on each, every message crosses between threads (a pair
//! ring one way, a release note back): the machinery of issue 18 is what is counted.

use rdsd_tests::netns::{Lab, VethPair};
use rdsd_tests::*;
use std::collections::HashMap;
use std::net::SocketAddrV4;
use std::time::Duration;

const WARM_UP: u64 = 200;
const ROUND_TRIPS: u64 = 500;

/// Two spinning poll threads (tests never pin: the machine has two CPUs).
const TWO_SPINNING: [&str; 6] = ["--poll-core", "-2", "--poll-core", "-2", "--idle", "spin"];

/// Each poll thread's [passes, allocations, locks, records out] as it last published them,
/// read by the control thread (`rdsctl info -c`: no poll thread is asked, so the read costs
/// them nothing).
fn per_thread(d: &Daemon) -> Vec<[u64; 4]> {
    let doc = d.info_json(&["-c"]);
    let threads = doc["thread_counters"].as_array().expect("thread_counters");
    threads
        .iter()
        .map(|t| {
            let v = |k: &str| t.get(k).and_then(|x| x.as_u64()).unwrap_or(0);
            [
                v("poll_passes"),
                v("poll_allocations"),
                v("poll_locks"),
                v("shard_records_out"),
            ]
        })
        .collect()
}

/// [allocations, locks, records out] of all poll threads, as published after every one of
/// them has made 512 more passes (a spinning thread publishes every 256): so each has
/// published since this call began, and everything it did before is counted.
fn settled(d: &Daemon) -> [u64; 3] {
    let start = per_thread(d);
    let now = wait_until(
        Duration::from_secs(20),
        "every poll thread to publish its counters again",
        || per_thread(d),
        |now| now.len() == start.len() && now.iter().zip(&start).all(|(n, s)| n[0] >= s[0] + 512),
    );
    let sum = |i: usize| now.iter().map(|t| t[i]).sum();
    [sum(1), sum(2), sum(3)]
}

/// A traced poll thread's name and its system calls by name.
type Calls = Vec<(String, HashMap<String, u64>)>;

/// What [`counted`] returns: per daemon, the counters before and after; per traced thread,
/// its system calls.
type Counted = (Vec<[u64; 3]>, Vec<[u64; 3]>, Calls);

/// Runs `round` for the warm-up, then for the counted rounds with strace on each poll thread
/// of `daemons` listed in `traced` (daemon index, thread).
fn counted(daemons: &[&Daemon], traced: &[(usize, usize)], mut round: impl FnMut(u64)) -> Counted {
    for seq in 0..WARM_UP {
        round(seq);
    }
    let before: Vec<[u64; 3]> = daemons.iter().map(|d| settled(d)).collect();
    let straces: Vec<_> = traced
        .iter()
        .map(|&(d, k)| PollThreadSyscalls::attach_at(daemons[d], k))
        .collect();
    for seq in WARM_UP..WARM_UP + ROUND_TRIPS {
        round(seq);
    }
    let mut calls = Vec::new();
    for (st, &(d, k)) in straces.into_iter().zip(traced) {
        let Some(st) = st else { continue };
        let (text, m) = st.finish();
        let total: u64 = m.values().sum();
        eprintln!("daemon {d}, poll thread {k}: {total} system calls\n{text}");
        calls.push((format!("daemon {d}, rdsd-poll-{k}"), m));
    }
    let after: Vec<[u64; 3]> = daemons.iter().map(|d| settled(d)).collect();
    (before, after, calls)
}

/// No allocation and no lock on any daemon's poll threads over the counted round trips, and
/// at least `crossings_per_round_trip` records between threads (all daemons together).
fn assert_quiet(before: &[[u64; 3]], after: &[[u64; 3]], crossings_per_round_trip: u64) {
    let mut crossed = 0;
    for (d, (b, a)) in before.iter().zip(after).enumerate() {
        eprintln!(
            "daemon {d}: {} allocations, {} locks, {} records crossed in {ROUND_TRIPS} round trips",
            a[0] - b[0],
            a[1] - b[1],
            a[2] - b[2]
        );
        assert_eq!(
            a[0], b[0],
            "daemon {d}: poll threads allocated in steady state"
        );
        assert_eq!(
            a[1], b[1],
            "daemon {d}: poll threads took a lock in steady state"
        );
        crossed += a[2] - b[2];
    }
    assert!(
        crossed >= crossings_per_round_trip * ROUND_TRIPS,
        "{crossed} records crossed between poll threads in {ROUND_TRIPS} round trips: not the traffic meant"
    );
}

/// Not one system call on any traced thread.
fn assert_no_calls(calls: &Calls) {
    for (who, m) in calls {
        let n: u64 = m.values().sum();
        assert_eq!(n, 0, "{who}: system calls in steady state (strace above)");
    }
}

/// Two apps on one rdsd, each on its own poll thread: every request and reply crosses.
#[test]
fn crossing_between_poll_threads_allocates_locks_and_calls_nothing() {
    let d = Daemon::start(&TWO_SPINNING);
    let (a0, a1): (SocketAddrV4, SocketAddrV4) = (
        "127.0.0.1:7500".parse().unwrap(),
        "127.0.0.1:7501".parse().unwrap(),
    );
    // One round trip more than counted: the reply side is still in its loop when its trace
    // ends (its exit is no steady state).
    let mut pp = PingPong::start_spinning_on(
        apps_on_two_threads(&d),
        [a0, a1],
        WARM_UP + ROUND_TRIPS + 1,
        Duration::from_secs(20),
    );
    // The replying app's thread too: the library's send and its non-blocking receive make no
    // system call per message (shm-api: "the data path makes no syscall"). Its calls are the
    // yields of its spinning receive, and the liveness check of rdsd that an empty receive
    // makes at most once a millisecond (a `poll` of the control socket).
    let traced = std::time::Instant::now();
    let echo = PollThreadSyscalls::attach_thread(std::process::id(), pp.echo_tid(), "the app");
    let (before, after, calls) = counted(&[&d], &[(0, 0), (0, 1)], |seq| pp.round_trip(seq));
    if let Some(echo) = echo {
        let (text, m) = echo.finish();
        let ms = traced.elapsed().as_millis() as u64;
        eprintln!("the replying app's thread, {ms} ms:\n{text}");
        for (name, &n) in &m {
            match name.as_str() {
                "sched_yield" => {}
                "poll" => assert!(n <= ms + 1, "{n} liveness polls in {ms} ms"),
                _ => panic!("{n} {name} by the app's thread (strace above)"),
            }
        }
        assert!(!m.is_empty(), "strace saw the app's thread yield");
    }
    pp.round_trip(WARM_UP + ROUND_TRIPS);
    pp.finish();
    // The counters count: attaching and binding allocated and took the bind directory's lock.
    assert!(
        after[0][0] > 0 && after[0][1] > 0,
        "poll_allocations {} and poll_locks {} after attaches and binds",
        after[0][0],
        after[0][1]
    );
    // A request and a reply cross per round trip (records), each sender's release returns as a
    // note (not a record).
    assert_quiet(&before, &after, 2);
    assert_no_calls(&calls);
}

/// Two apps of one rdsd, sorted so that the first is poll thread 0's and the second 1's.
fn apps_on_two_threads(d: &Daemon) -> [shm_api::Rdsd; 2] {
    let mut apps = [d.attach(), d.attach()];
    apps.sort_by_key(|a| a.poll_thread());
    assert_eq!((apps[0].poll_thread(), apps[1].poll_thread()), (0, 1));
    for a in &apps {
        eprintln!("DBG app on {}", a.poll_thread());
    }
    apps
}

/// Opens the connection between two daemons of two poll threads each, and returns for each
/// an attachment on the thread that does not own it (attaching until one lands there: each
/// new app goes to the thread with the fewest, and the apps that came before may still be
/// leaving), and the apps to keep attached meanwhile.
fn off_the_connections_thread(
    d: [&Daemon; 2],
    addrs: [std::net::Ipv4Addr; 2],
) -> ([shm_api::Rdsd; 2], Vec<shm_api::Rdsd>) {
    let mut keep: Vec<shm_api::Rdsd> = d.iter().map(|d| d.attach()).collect();
    let (x0, x1) = (keep[0].socket().unwrap(), keep[1].socket().unwrap());
    x0.bind(SocketAddrV4::new(addrs[0], 7501)).unwrap();
    x1.bind(SocketAddrV4::new(addrs[1], 7501)).unwrap();
    x1.set_recv_timeout(Some(Duration::from_secs(20))).unwrap();
    x0.send_to(b"open", SocketAddrV4::new(addrs[1], 7501))
        .unwrap();
    x1.recv_from(&mut [0u8; 8]).expect("the connection is up");
    let off = d.map(|d| {
        let owner = d.info_json(&["-n"])["connections"][0]["shard"]
            .as_u64()
            .expect("the connection's thread") as usize;
        for _ in 0..8 {
            let app = d.attach();
            if app.poll_thread() != owner {
                return app;
            }
            keep.push(app);
        }
        panic!("no app placed off the connection's thread {owner}");
    });
    (off, keep)
}

/// A non-blocking socket of `app` bound to 127.0.0.1:`port`.
fn bound(app: &shm_api::Rdsd, port: u16) -> shm_api::Socket {
    let s = app.socket().unwrap();
    s.bind(lo(port)).unwrap();
    s.set_nonblocking(true).unwrap();
    s
}

/// Spinning receive of one message of `len` bytes.
fn take(s: &shm_api::Socket, buf: &mut [u8], len: usize) {
    let (n, _) = recv_spinning(s, buf, Duration::from_secs(20)).expect("a message");
    assert_eq!(n, len);
}

/// 64 KiB requests (from `CROSS_IN_PLACE_MIN` on, a message crosses as a reference into the
/// sender's tx ring, held until the receiver's thread has copied it: `DeliverRef`, a hold, a
/// release note) and 64 B replies between apps on two threads.
#[test]
fn large_messages_crossing_in_place_allocate_lock_and_call_nothing() {
    const BIG: usize = 64 << 10;
    let d = Daemon::start(&TWO_SPINNING);
    let [app0, app1] = apps_on_two_threads(&d);
    let (a, b) = (bound(&app0, 7510), bound(&app1, 7511));
    let (big, mut buf) = (vec![0x5a_u8; BIG], vec![0u8; BIG]);
    let (before, after, calls) = counted(&[&d], &[(0, 0), (0, 1)], |_| {
        a.send_to(&big, lo(7511)).expect("request");
        take(&b, &mut buf, BIG);
        b.send_to(&buf[..64], lo(7510)).expect("reply");
        take(&a, &mut buf, 64);
    });
    assert_quiet(&before, &after, 2);
    assert_no_calls(&calls);
}

/// A multicast group (issue 20) whose members sit on both threads and whose sender is thread
/// 1's: shard 0 orders the group, so each message crosses to it and a copy comes back to the
/// member of thread 1, with the group's credit notes.
#[test]
fn group_messages_across_poll_threads_allocate_lock_and_call_nothing() {
    let d = Daemon::start(&TWO_SPINNING);
    let [app0, app1] = apps_on_two_threads(&d);
    let g = SocketAddrV4::new(std::net::Ipv4Addr::new(239, 1, 2, 9), 5500);
    let creator = bound(&app1, 7520);
    creator.group_create(g).unwrap();
    let (m0, m1) = (bound(&app0, 7521), bound(&app1, 7522));
    for m in [&m0, &m1] {
        m.group_join(g, shm_api::GroupFlags::NONE).unwrap();
    }
    let sender = bound(&app1, 7523);
    let mut buf = vec![0u8; 256];
    let (before, after, calls) = counted(&[&d], &[(0, 0), (0, 1)], |seq| {
        sender
            .send_to(&seq_payload(seq, 64), g)
            .expect("group send");
        for m in [&m0, &m1] {
            take(m, &mut buf, 64);
            assert_eq!(payload_seq(&buf[..64]), seq, "each member, in order");
        }
    });
    // To shard 0 and a copy back, per message.
    assert_quiet(&before, &after, 2);
    assert_no_calls(&calls);
}

/// Kernel TCP between two hosts (namespaces), each rdsd on two poll threads, the app on the
/// thread that does not own the connection: requests and replies cross to the connection's
/// thread and back. Kernel TCP is not kernel bypass: a spinning pass asks epoll which paths
/// are ready, and a round trip's messages are a `sendmsg` and a `recvfrom` each way, with
/// `SIOCOUTQ` queries for their acknowledgements; nothing else (an eventfd write per crossing
/// would show here too), and no allocation and no lock.
#[test]
fn kernel_tcp_across_poll_threads_allocates_and_locks_nothing() {
    let lab = Lab::new(2, 2, &TWO_SPINNING);
    let (h0, h1) = (&lab.hosts[0], &lab.hosts[1]);
    let (a0, a1): (SocketAddrV4, SocketAddrV4) =
        (h0.at(7500).parse().unwrap(), h1.at(7500).parse().unwrap());
    let (apps, _keep) = off_the_connections_thread([h0.d(), h1.d()], [*a0.ip(), *a1.ip()]);
    let mut pp = PingPong::start_spinning_on(
        apps,
        [a0, a1],
        WARM_UP + ROUND_TRIPS,
        Duration::from_secs(20),
    );
    let (before, after, calls) = counted(
        &[h0.d(), h1.d()],
        &[(0, 0), (0, 1), (1, 0), (1, 1)],
        |seq| pp.round_trip(seq),
    );
    pp.finish();
    // On each host, the request or reply to the connection's thread and the other back.
    assert_quiet(&before, &after, 4);
    let allowed = ["epoll_wait", "ioctl", "sendmsg", "recvfrom"];
    for (who, m) in &calls {
        for (name, &n) in m {
            assert!(
                allowed.contains(&name.as_str()),
                "{who}: {n} {name} in steady state (strace above)"
            );
        }
        let per = |k: &str| m.get(k).copied().unwrap_or(0) as f64 / ROUND_TRIPS as f64;
        // The owner of the connection: one message out and one in per round trip (a write
        // can be split, a read can find half a message); the other thread: none.
        assert!(
            per("sendmsg") <= 1.5 && per("recvfrom") <= 2.0,
            "{who}: {} sendmsg and {} recvfrom per round trip",
            per("sendmsg"),
            per("recvfrom")
        );
    }
}

/// Userspace TCP over DPDK memif (the kernel-bypass path), each rdsd on two poll threads with
/// a queue pair each: no allocation, no lock and no system call on any of the four poll
/// threads.
#[test]
fn dpdk_across_poll_threads_allocates_locks_and_calls_nothing() {
    dpdk_quiet(2);
}

/// The same with DPDK's default one queue pair: thread 0 drives the port, thread 1's apps
/// reach it through the pair rings.
#[test]
fn dpdk_on_one_queue_pair_across_poll_threads_allocates_locks_and_calls_nothing() {
    dpdk_quiet(1);
}

/// A memif ping-pong between two rdsd of two spinning poll threads and `queues` queue pairs,
/// each app off its connection's thread.
fn dpdk_quiet(queues: u16) {
    require!(
        root(),
        "run as root with DPDK 22.11 installed: sudo -E bash tests/run.sh"
    );
    let pair = VethPair::new();
    let sock = std::env::temp_dir().join(format!(
        "rdsd-memif-quiet-{}-{queues}.sock",
        std::process::id()
    ));
    let _ = std::fs::remove_file(&sock);
    let lines = format!("queues = {queues}");
    let d0 = pair.memif_daemon_with(0, &sock, 1, &lines, &TWO_SPINNING);
    let d1 = pair.memif_daemon_with(1, &sock, 1, &lines, &TWO_SPINNING);
    let (a0, a1) = (
        SocketAddrV4::new(pair.addr(0), 7500),
        SocketAddrV4::new(pair.addr(1), 7500),
    );
    let (apps, _keep) = off_the_connections_thread([&d0, &d1], [pair.addr(0), pair.addr(1)]);
    let mut pp = PingPong::start_spinning_on(
        apps,
        [a0, a1],
        WARM_UP + ROUND_TRIPS,
        Duration::from_secs(20),
    );
    let all = [(0, 0), (0, 1), (1, 0), (1, 1)];
    let (before, after, calls) = counted(&[&d0, &d1], &all, |seq| pp.round_trip(seq));
    pp.finish();
    // On each host, the request or reply to the connection's thread and the other back.
    assert_quiet(&before, &after, 4);
    assert_no_calls(&calls);
    drop((d0, d1));
    let _ = std::fs::remove_file(&sock);
}

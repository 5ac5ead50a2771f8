//! The quiet fast path (ARCHITECTURE.md, invariant 4), counted on the real daemon: in steady
//! traffic its poll threads make no heap allocation (`poll_allocations`, counted by rdsd's
//! allocator), take none of rdsd's locks (`poll_locks`) and, where the transport does not go
//! through the kernel, make no system call at all (`strace -c` on every poll thread).
//!
//! Each test warms a 64 B ping-pong up (connections, paths, rings, backlogs and stashes grown
//! to what the traffic needs), then counts over the next round trips. The apps receive without
//! ever sleeping in rdsd's library (non-blocking tries and `sched_yield`, `PingPong::start_spinning`)
//! and the poll threads spin (`--idle spin`): a sleeping app needs a `futex_wake` and a parked
//! poll thread a `ppoll`, the two documented exceptions, which are not steady state.
//!
//! With two poll threads and an app on each, every message crosses between threads (a pair
//! ring one way, a release note back): the machinery of issue 18 is what is counted.

use rdsd_tests::netns::{Lab, VethPair};
use rdsd_tests::*;
use std::net::SocketAddrV4;
use std::time::Duration;

const WARM_UP: u64 = 200;
const ROUND_TRIPS: u64 = 500;

/// Two spinning poll threads (tests never pin: the machine has two CPUs).
const TWO_SPINNING: [&str; 6] = ["--poll-core", "-2", "--poll-core", "-2", "--idle", "spin"];

/// The counters the test compares, from the plain stats (read by the control thread, so the
/// read itself costs the poll threads nothing; spinning poll threads publish every 256 passes).
fn quiet_counters(d: &Daemon) -> [u64; 3] {
    let s = d.stats();
    [
        stat_from(&s, "poll_allocations"),
        stat_from(&s, "poll_locks"),
        stat_from(&s, "shard_records_out"),
    ]
}

/// Counters as published after the last round trip: a spinning thread publishes every 256
/// passes, so wait until two reads agree on its pass count having moved past them.
fn settled(d: &Daemon) -> [u64; 3] {
    let passes = d.stat("poll_passes");
    wait_until(
        Duration::from_secs(10),
        "the poll threads to publish their counters again",
        || d.stat("poll_passes"),
        |&p| p > passes + 1024,
    );
    quiet_counters(d)
}

/// What [`counted`] returns: per daemon, the counters before and after; per traced thread,
/// its name and system calls.
type Counted = (Vec<[u64; 3]>, Vec<[u64; 3]>, Vec<(String, u64)>);

/// Runs the counted round trips with strace on each poll thread of `daemons` listed in
/// `traced` (daemon index, thread).
fn counted(pp: &mut PingPong, daemons: &[&Daemon], traced: &[(usize, usize)]) -> Counted {
    for seq in 0..WARM_UP {
        pp.round_trip(seq);
    }
    let before: Vec<[u64; 3]> = daemons.iter().map(|d| settled(d)).collect();
    let straces: Vec<_> = traced
        .iter()
        .map(|&(d, k)| PollThreadSyscalls::attach_at(daemons[d], k))
        .collect();
    for seq in WARM_UP..WARM_UP + ROUND_TRIPS {
        pp.round_trip(seq);
    }
    let mut calls = Vec::new();
    for (st, &(d, k)) in straces.into_iter().zip(traced) {
        let Some(st) = st else { continue };
        let (text, m) = st.finish();
        let total: u64 = m.values().sum();
        eprintln!("daemon {d}, poll thread {k}: {total} system calls\n{text}");
        calls.push((format!("daemon {d}, rdsd-poll-{k}"), total));
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

/// Two apps on one rdsd, each on its own poll thread: every request and reply crosses.
#[test]
fn crossing_between_poll_threads_allocates_locks_and_calls_nothing() {
    let d = Daemon::start(&TWO_SPINNING);
    let (a0, a1): (SocketAddrV4, SocketAddrV4) = (
        "127.0.0.1:7500".parse().unwrap(),
        "127.0.0.1:7501".parse().unwrap(),
    );
    let mut pp = PingPong::start_spinning(
        &d,
        a0,
        &d,
        a1,
        WARM_UP + ROUND_TRIPS,
        Duration::from_secs(20),
    );
    let (before, after, calls) = counted(&mut pp, &[&d], &[(0, 0), (0, 1)]);
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
    for (who, n) in calls {
        assert_eq!(n, 0, "{who}: system calls in steady state (strace above)");
    }
}

/// Kernel TCP between two hosts (namespaces), each rdsd on two poll threads, the app on the
/// thread that does not own the connection: requests and replies cross to the connection's
/// thread and back. Kernel TCP is not kernel bypass (its reads and writes are system calls),
/// so only allocations and locks are counted.
#[test]
fn kernel_tcp_across_poll_threads_allocates_and_locks_nothing() {
    let lab = Lab::new(2, 2, &TWO_SPINNING);
    let (h0, h1) = (&lab.hosts[0], &lab.hosts[1]);
    // A first app on each host takes thread 0 (the fewest apps), so the ping-pong's are thread
    // 1's; the connection goes to the thread with the fewest connections when first seen, 0 on
    // the connecting host at least.
    let (_first0, _first1) = (h0.d().attach(), h1.d().attach());
    let (a0, a1): (SocketAddrV4, SocketAddrV4) =
        (h0.at(7500).parse().unwrap(), h1.at(7500).parse().unwrap());
    let mut pp = PingPong::start_spinning(
        h0.d(),
        a0,
        h1.d(),
        a1,
        WARM_UP + ROUND_TRIPS,
        Duration::from_secs(20),
    );
    let (before, after, _) = counted(&mut pp, &[h0.d(), h1.d()], &[]);
    pp.finish();
    // On the connecting host: the app's message to the connection's thread, the peer's back.
    assert_quiet(&before, &after, 2);
}

/// Userspace TCP over DPDK memif (the kernel-bypass path), each rdsd on two poll threads with
/// a queue pair each: no allocation, no lock and no system call on any of the four poll
/// threads.
#[test]
fn dpdk_across_poll_threads_allocates_locks_and_calls_nothing() {
    require!(
        root(),
        "run as root with DPDK 22.11 installed: sudo -E bash tests/run.sh"
    );
    let pair = VethPair::new();
    let sock = std::env::temp_dir().join(format!("rdsd-memif-quiet-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&sock);
    let d0 = pair.memif_daemon_with(0, &sock, 1, "queues = 2", &TWO_SPINNING);
    let d1 = pair.memif_daemon_with(1, &sock, 1, "queues = 2", &TWO_SPINNING);
    let (_first0, _first1) = (d0.attach(), d1.attach());
    let (a0, a1) = (
        SocketAddrV4::new(pair.addr(0), 7500),
        SocketAddrV4::new(pair.addr(1), 7500),
    );
    let mut pp = PingPong::start_spinning(
        &d0,
        a0,
        &d1,
        a1,
        WARM_UP + ROUND_TRIPS,
        Duration::from_secs(20),
    );
    let all = [(0, 0), (0, 1), (1, 0), (1, 1)];
    let (before, after, calls) = counted(&mut pp, &[&d0, &d1], &all);
    pp.finish();
    // The connection's thread is a hash of the address pair, the same at both ends, and the
    // apps are thread 1's: on one of the two hosts at least, messages cross.
    assert_quiet(&before, &after, 2);
    for (who, n) in calls {
        assert_eq!(n, 0, "{who}: system calls in steady state (strace above)");
    }
    drop((d0, d1));
    let _ = std::fs::remove_file(&sock);
}
